"""Import Triton when it is installed; otherwise stand-ins so kernel modules still import.

CPU-only installs (CI, laptops) have no Triton. Kernel modules do `from ._triton import triton, tl`
and decorate with `@triton.jit` as usual; without Triton the decorator returns the plain function
and `tl.*` annotations resolve to placeholders, so the module imports and its torch reference
functions work. Launching a kernel without Triton raises through `require_triton()`.
"""

import types

from tokenforge import envs

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only install
    HAS_TRITON = False

    def _jit(fn=None, **_kwargs):
        return fn if fn is not None else (lambda f: f)

    def _cdiv(a: int, b: int) -> int:
        return -(-a // b)

    def _next_power_of_2(n: int) -> int:
        return 1 if n <= 1 else 1 << (n - 1).bit_length()

    triton = types.SimpleNamespace(jit=_jit, cdiv=_cdiv, next_power_of_2=_next_power_of_2)

    class _Placeholder(types.SimpleNamespace):
        def __getattr__(self, _name: str) -> type:
            return object  # annotations such as `tl.constexpr` only need to evaluate

    tl = _Placeholder()


def require_triton(*tensors) -> None:
    """Raise a clear error when a Triton kernel cannot run here."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed: use the torch reference path on this machine")
    for t in tensors:
        if not t.is_cuda and not _interpreting():
            raise RuntimeError(f"Triton kernels need CUDA tensors, got a tensor on {t.device}")


def _interpreting() -> bool:
    # TRITON_INTERPRET=1 runs kernels on the CPU through numpy: used to debug without a GPU.
    return envs.triton_interpret()


_pdl_setting: bool | None = None          # None: on where the GPU supports it (sm90+)
_pdl_capable: dict[int, bool] = {}


def set_pdl(enabled: bool | None) -> None:
    """Force programmatic dependent launch on or off (None restores the default: on for sm90+).

    With PDL each kernel may be launched while its predecessor drains; the kernel waits
    (griddepcontrol.wait) before touching memory, so results are unchanged and only the launch
    latency overlaps. The setting is read at launch, so a captured CUDA graph keeps the setting
    it was captured with.
    """
    global _pdl_setting
    _pdl_setting = enabled


def use_pdl(t) -> bool:
    """Whether kernels launched on t's device use PDL."""
    if not (HAS_TRITON and t.is_cuda) or _pdl_setting is False:
        return False
    idx = t.device.index if t.device.index is not None else 0
    if idx not in _pdl_capable:
        import torch

        _pdl_capable[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _pdl_capable[idx]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
