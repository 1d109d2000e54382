"""Which implementation the fused layers (norm, rotary, activation, small-batch linears) use.

The torch path is the reference and the CPU path. On CUDA, when `tokenforge.kernels` imports with
Triton available, the layers call its fused kernels instead. The choice is made per call from the
tensor's device (a dict lookup), so one model object works on either device, and tests can force
the torch path with `use_triton_kernels(False)`.

Linears take the Triton GEMVs (`gemv_ops`) only at decode sizes (<= GEMV_MAX_TOKENS rows) with
16-bit weights and no autograd; everything else keeps cuBLAS (or the CPU's packed weights).
`use_gemv_kernels(False)` turns off just the GEMVs.
"""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import torch

from tokenforge.model.forward_context import is_training

logger = logging.getLogger(__name__)

GEMV_MAX_TOKENS = 1       # measured on an H200: faster than cuBLAS at M = 1, slower at M = 2-4; a tensor-core
                          # (tl.dot) variant for 2-16 rows lost too (a verify's 5 rows, H100: BENCHMARKS.md round 12)
_GEMV_DTYPES = (torch.bfloat16, torch.float16)

_enabled = True
_gemv_enabled = True


def use_triton_kernels(enabled: bool) -> None:
    """Allow (default) or forbid the Triton kernels; forbidding makes CUDA run the torch path."""
    global _enabled
    _enabled = enabled


def use_gemv_kernels(enabled: bool) -> None:
    """Allow (default) or forbid the Triton GEMVs alone (the other fused kernels are unaffected)."""
    global _gemv_enabled
    _gemv_enabled = enabled


@functools.cache
def _load_triton_ops() -> SimpleNamespace | None:
    try:
        from tokenforge.kernels import activation, gemv, gemv_lora, rms_norm, rotary  # noqa: PLC0415 - optional
        from tokenforge.kernels._triton import HAS_TRITON  # noqa: PLC0415
    except ImportError as exc:  # kernels are optional: the torch path always works
        logger.info("Triton kernels unavailable (%s); using torch layers", exc)
        return None
    if not HAS_TRITON:
        return None
    return SimpleNamespace(
        rms_norm=rms_norm.rms_norm,
        fused_add_rms_norm=rms_norm.fused_add_rms_norm,
        apply_rotary=rotary.apply_rotary,
        silu_and_mul=activation.silu_and_mul,
        gemv=gemv.gemv,
        add_rms_norm_gemv=gemv.add_rms_norm_gemv,
        silu_mul_gemv=gemv.silu_mul_gemv,
        fuses_prologue=gemv.fuses_prologue,
        gemv_lora=gemv_lora.gemv_lora,
        add_rms_norm_gemv_lora=gemv_lora.add_rms_norm_gemv_lora,
        silu_mul_gemv_lora=gemv_lora.silu_mul_gemv_lora,
        gemv_lora_deferred=gemv_lora.gemv_lora_deferred,
        add_lora_delta=gemv_lora.add_lora_delta,
        prologues=SimpleNamespace(plain=gemv.PLAIN, norm=gemv.NORM, silu_mul=gemv.SILU_MUL),
    )


def triton_ops(device: torch.device) -> SimpleNamespace | None:
    """The Triton kernel namespace for tensors on `device`, or None to use torch (always within a
    training forward: the kernels have no backward)."""
    if device.type != "cuda" or not _enabled or is_training():
        return None
    return _load_triton_ops()


def gemv_ops(x: torch.Tensor, weight: torch.Tensor) -> SimpleNamespace | None:
    """The Triton namespace when x [T, in] @ weight^T should run as a GEMV, else None (cuBLAS/CPU)."""
    if (not _gemv_enabled or x.dim() != 2 or x.shape[0] > GEMV_MAX_TOKENS or weight.dtype not in _GEMV_DTYPES
            or x.dtype != weight.dtype or weight.stride(-1) != 1
            or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))):   # no backward
        return None
    return triton_ops(x.device)
