"""The CPU GGUF matmul: x [M, K] float32 times a PackedWeight (kernels/gguf_repack.py) -> [M, N].

Activations are quantized per block of 32 to int8 (scale amax / 127, round half to even), then
gguf_cpu.cpp takes integer dot products per block (AVX2, VNNI where present) and applies the
weight's scale and min in float, as llama.cpp does. The C++ is compiled once per machine with the
system g++ (`-O3 -march=native -fopenmp`, a few seconds) into the tokenforge cache and called
with ctypes: no pybind, no torch headers. The same library holds gguf_decode.cpp (a whole decode
step in one call, kernels/gguf_decode.py); the loops both share are in gguf_kernels.h. Its OpenMP
runtime is torch's own libgomp.so.1 (already loaded), so the two share one thread pool. Without a compiler (or when the build fails) the
torch reference below computes the same numbers, slowly.

Weights arrive as `RowBlocks` (gguf_repack.repack, or `repack_fast`) and are kept only as
`PackedWeight` panels of 16 rows (`panels`), which the kernels, the dequantization and the
reference all read.

`gguf_matmul_ref` is the reference every kernel path is tested against; `rms_norm_ref` and
`silu_mul_ref` are the prologues the fused quantizers (`rms_norm_quantize`, `silu_mul_quantize`:
the add + RMSNorm or SwiGLU computed and quantized in one call, for the decode step) must match.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from tokenforge.kernels.gguf_repack import (I8, I8_32, PANEL, Q4_0, Q4_1, Q8_0, U4, PackedWeight, RowBlocks,
                                            dequantize_packed, repack, to_panels)

logger = logging.getLogger(__name__)

# One library from both sources: per-projection kernels and the whole decode step (gguf_decode.py).
_SOURCES = tuple(Path(__file__).with_name(name) for name in ("gguf_cpu.cpp", "gguf_decode.cpp"))
_HEADER = Path(__file__).with_name("gguf_kernels.h")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "tokenforge" / "kernels"


def native_library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None without a C++ compiler (a warning, once)."""
    return build_library()


@functools.cache
def build_library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library built with _FLAGS + extra_flags (tests build `-mno-avx512f` and `-mno-avx2` too,
    to check the AVX2 and plain-loop panel kernels on this CPU)."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        logger.warning("no C++ compiler found: GGUF weights run through the slow torch reference")
        return None
    flags = [*_FLAGS, *extra_flags]
    source = b"".join(path.read_bytes() for path in (*_SOURCES, _HEADER))
    with open("/proc/cpuinfo", "rb") if Path("/proc/cpuinfo").exists() else open(os.devnull, "rb") as f:
        cpu = next((line for line in f if line.startswith(b"flags")), b"")
    digest = hashlib.sha256(source + " ".join(flags).encode() + cpu).hexdigest()[:16]
    target = _cache_dir() / f"gguf_cpu-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *flags, *map(str, _SOURCES), "-o", str(built)], capture_output=True, text=True)
            if result.returncode:
                logger.warning("building the GGUF CPU kernel failed (%s): using the torch reference",
                               result.stderr.strip().splitlines()[-1:] or result.returncode)
                return None
            os.replace(built, target)        # atomic: concurrent builders never load half a file
    lib = ctypes.CDLL(str(target))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    signatures = {"tf_quantize_activations": [ptr, i64, i64, ptr, ptr, ptr],
                  "tf_rms_norm_quantize": [ptr, ptr, ptr, ptr, ctypes.c_float, i64, i64, ptr, ptr, ptr],
                  "tf_silu_mul_quantize": [ptr, i64, i64, ptr, ptr, ptr],
                  "tf_gguf_matmul": [ctypes.c_int, ptr, ptr, ptr, i64, i64, ptr, ptr, ptr, i64, ptr],
                  "tf_repack_panels": [ctypes.c_int, ptr, ptr, ptr, i64, i64, ptr, ptr, ptr],
                  "tf_decode_step": [ptr, ptr, ptr],
                  "tf_repack_legacy": [ctypes.c_int, ptr, i64, ptr, ptr, ptr],
                  "tf_dequantize": [ctypes.c_int, ptr, ptr, ptr, i64, i64, ptr],
                  "tf_dequantize_bf16": [ctypes.c_int, ptr, ptr, ptr, i64, i64, ptr]}
    for name, argtypes in signatures.items():      # declared once: each call converts plain ints
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    lib.tf_has_avx512_vnni.argtypes, lib.tf_has_avx512_vnni.restype = [], ctypes.c_int
    return lib


MAX_FUSED_ROW = 16384       # gguf_cpu.cpp's kMaxRow: the widest row its fused prologues take


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 [M, K] -> xq int8 [M, K], dx float32 [M, K/32], xsum int32 [M, K/16]."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    dx = blocks.abs().amax(dim=-1) / 127.0
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    xq = torch.round(blocks * inv.unsqueeze(-1)).to(torch.int8).reshape(m, k)
    return xq, dx, xq.reshape(m, -1, 16).sum(-1, dtype=torch.int32)


def rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * RMSNorm(x [+ residual]), x [+ residual]): what tf_rms_norm_quantize quantizes."""
    h = x if residual is None else x + residual
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)), h


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[M, 2K] -> silu(gate) * up [M, K]: what tf_silu_mul_quantize quantizes."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gguf_matmul_ref(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """The reference: quantized activations times the dequantized weight, in float64 (order-free)."""
    xq, dx, _ = quantize_activations_ref(x)
    x_hat = (xq.reshape(x.shape[0], -1, 32).double() * dx.double().unsqueeze(-1)).reshape(x.shape)
    return (x_hat @ dequantize_packed(w).double().T).float()


class Activations:
    """Activations quantized for the native kernel: xq int8 [M, K], dx [M, K/32], xs int32 [M, K/16]
    (the code sums per 16, what quantize_activations_ref returns third)."""

    __slots__ = ("dx", "xq", "xs")

    def __init__(self, m: int, k: int) -> None:
        self.xq = torch.empty(m, k, dtype=torch.int8)
        self.dx = torch.empty(m, k // 32, dtype=torch.float32)
        self.xs = torch.empty(m, k // 16, dtype=torch.int32)

    @property
    def pointers(self) -> tuple[int, int, int]:
        return self.xq.data_ptr(), self.dx.data_ptr(), self.xs.data_ptr()


def quantize_activations(lib: ctypes.CDLL, x: torch.Tensor) -> Activations:
    """x [M, K] float32 contiguous -> its Activations."""
    m, k = x.shape
    acts = Activations(m, k)
    lib.tf_quantize_activations(x.data_ptr(), m, k, *acts.pointers)
    return acts


def rms_norm_quantize(lib: ctypes.CDLL, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float) -> tuple[Activations, torch.Tensor]:
    """(the Activations of rms_norm_ref(x, residual, weight, eps), the new residual) in one call."""
    m, k = x.shape
    acts = Activations(m, k)
    if residual is None:
        lib.tf_rms_norm_quantize(x.data_ptr(), None, None, weight.data_ptr(), eps, m, k, *acts.pointers)
        return acts, x
    out = torch.empty_like(x)
    lib.tf_rms_norm_quantize(x.data_ptr(), residual.data_ptr(), out.data_ptr(), weight.data_ptr(), eps, m, k,
                             *acts.pointers)
    return acts, out


def silu_mul_quantize(lib: ctypes.CDLL, gate_up: torch.Tensor) -> Activations:
    """The Activations of silu_mul_ref(gate_up) [M, 2K] in one call."""
    m, k = gate_up.shape[0], gate_up.shape[1] // 2
    acts = Activations(m, k)
    lib.tf_silu_mul_quantize(gate_up.data_ptr(), m, k, *acts.pointers)
    return acts


def matmul_quantized(lib: ctypes.CDLL, acts: Activations, w: PackedWeight) -> torch.Tensor:
    """Activations [M, K] times w -> float32 [M, N]."""
    m, k = acts.xq.shape
    out = torch.empty(m, w.out_features, dtype=torch.float32)
    lib.tf_gguf_matmul(w.kind, *weight_pointers(w), w.out_features, k, *acts.pointers, m, out.data_ptr())
    return out


def weight_pointers(w: PackedWeight) -> tuple[int, int, int | None]:
    """(codes, scales, mins or None) for the native calls."""
    return w.q.data_ptr(), w.scale.data_ptr(), None if w.minv is None else w.minv.data_ptr()


def panels(w: RowBlocks) -> PackedWeight:
    """gguf_repack.to_panels in one native pass (its torch permutes cost more at start-up)."""
    lib = native_library()
    if lib is None:
        return to_panels(w)
    n, k = w.q.shape[0], w.in_features
    p, blocks = -(-n // PANEL), k // 32
    kind = w.kind
    if kind == I8 and torch.equal(w.scale[:, 0::2], w.scale[:, 1::2]) and torch.equal(w.minv[:, 0::2], w.minv[:, 1::2]):
        kind = I8_32
    # numpy's buffers: first touch of fresh torch.empty pages cost several times more on the dev VM
    q = torch.from_numpy(np.empty((p, blocks, 256 if kind == U4 else 512), dtype=np.uint8))
    scale = torch.from_numpy(np.empty((p, blocks, 2, PANEL) if kind == I8 else (p, blocks, PANEL), dtype=np.float32))
    minv = torch.from_numpy(np.empty(tuple(scale.shape), dtype=np.float32)) if w.has_min else None
    lib.tf_repack_panels(kind, w.q.data_ptr(), w.scale.data_ptr(), w.minv.data_ptr() if w.has_min else None, n, k,
                         q.data_ptr(), scale.data_ptr(), None if minv is None else minv.data_ptr())
    return PackedWeight(kind, q, scale, minv, n, k)


def gguf_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [..., K] float -> [..., N] float32 through the native kernel (or the reference)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features).float().contiguous()
    lib = native_library()
    if lib is None:
        return gguf_matmul_ref(x2, w).reshape(*lead, w.out_features)
    return matmul_quantized(lib, quantize_activations(lib, x2), w).reshape(*lead, w.out_features)


def dequantize_into(w: PackedWeight, out: torch.Tensor) -> torch.Tensor:
    """dequantize_packed(w) written into `out` (float32 or bfloat16 [N, K], contiguous; bfloat16
    rounds to nearest even as `.to(torch.bfloat16)` does), natively when the kernel is built (the
    torch version cost twice the prefill GEMM it feeds)."""
    assert out.dtype in (torch.float32, torch.bfloat16) and out.is_contiguous()
    lib = native_library()
    if lib is None:
        return out.copy_(dequantize_packed(w))
    fn = lib.tf_dequantize if out.dtype == torch.float32 else lib.tf_dequantize_bf16
    fn(w.kind, *weight_pointers(w), w.out_features, w.in_features, out.data_ptr())
    return out


def repack_fast(raw: torch.Tensor, ggml_type: int, in_features: int) -> RowBlocks:
    """gguf_repack.repack, with Q4_0 / Q4_1 / Q8_0 repacked in one native pass (start-up: the
    torch version's strided copies took seconds for the bundled model)."""
    lib = native_library()
    if lib is None or ggml_type not in (Q4_0, Q4_1, Q8_0) or not raw.is_contiguous():
        return repack(raw, ggml_type, in_features)
    n, blocks = raw.shape[0], in_features // 32
    u4 = ggml_type != Q8_0
    # numpy's buffers: first touch of fresh torch.empty pages cost several times more on the dev VM
    q = torch.from_numpy(np.empty((n, in_features // 2 if u4 else in_features), dtype=np.uint8 if u4 else np.int8))
    scale = torch.from_numpy(np.empty((n, blocks if u4 else 2 * blocks), dtype=np.float32))
    minv = torch.from_numpy(np.empty((n, blocks if u4 else 2 * blocks), dtype=np.float32))
    lib.tf_repack_legacy(ggml_type, raw.data_ptr(), n * blocks, q.data_ptr(), scale.data_ptr(), minv.data_ptr())
    return RowBlocks(U4 if u4 else I8, q, scale, minv, in_features, ggml_type != Q8_0)


__all__ = ["MAX_FUSED_ROW", "Activations", "build_library", "dequantize_into", "gguf_matmul", "gguf_matmul_ref",
           "matmul_quantized", "native_library", "panels", "quantize_activations", "quantize_activations_ref", "repack_fast",
           "rms_norm_quantize", "rms_norm_ref", "silu_mul_quantize", "silu_mul_ref", "weight_pointers"]
