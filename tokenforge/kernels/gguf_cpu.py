"""The CPU GGUF matmul: x [M, K] float32 times a PackedWeight (kernels/gguf_repack.py) -> [M, N].

Activations are quantized per block of 32 to int8 (scale amax / 127, round half to even), then
gguf_cpu.cpp takes integer dot products per block (AVX2, VNNI where present) and applies the
weight's scale and min in float, as llama.cpp does. The C++ is compiled once per machine with the
system g++ (`-O3 -march=native -fopenmp`, about 2 s) into the tokenforge cache and called with
ctypes: no pybind, no torch headers. Its OpenMP runtime is torch's own libgomp.so.1 (already
loaded), so the two share one thread pool. Without a compiler (or when the build fails) the
torch reference below computes the same numbers, slowly.

`gguf_matmul_ref` is the reference every kernel path is tested against.
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

import torch

from tokenforge.kernels.gguf_repack import PackedWeight, dequantize_packed

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("gguf_cpu.cpp")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "tokenforge" / "kernels"


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None without a C++ compiler (a warning, once)."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        logger.warning("no C++ compiler found: GGUF weights run through the slow torch reference")
        return None
    source = _SOURCE.read_bytes()
    with open("/proc/cpuinfo", "rb") if Path("/proc/cpuinfo").exists() else open(os.devnull, "rb") as f:
        cpu = next((line for line in f if line.startswith(b"flags")), b"")
    digest = hashlib.sha256(source + " ".join(_FLAGS).encode() + cpu).hexdigest()[:16]
    target = _cache_dir() / f"gguf_cpu-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built)], capture_output=True, text=True)
            if result.returncode:
                logger.warning("building the GGUF CPU kernel failed (%s): using the torch reference",
                               result.stderr.strip().splitlines()[-1:] or result.returncode)
                return None
            os.replace(built, target)        # atomic: concurrent builders never load half a file
    lib = ctypes.CDLL(str(target))
    lib.tf_quantize_activations.restype = None
    lib.tf_gguf_matmul.restype = None
    return lib


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 [M, K] -> xq int8 [M, K], dx float32 [M, K/32], xsum int32 [M, K/16]."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    dx = blocks.abs().amax(dim=-1) / 127.0
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    xq = torch.round(blocks * inv.unsqueeze(-1)).to(torch.int8).reshape(m, k)
    return xq, dx, xq.reshape(m, -1, 16).sum(-1, dtype=torch.int32)


def gguf_matmul_ref(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """The reference: quantized activations times the dequantized weight, in float64 (order-free)."""
    xq, dx, _ = quantize_activations_ref(x)
    x_hat = (xq.reshape(x.shape[0], -1, 32).double() * dx.double().unsqueeze(-1)).reshape(x.shape)
    return (x_hat @ dequantize_packed(w).double().T).float()


def gguf_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [..., K] float -> [..., N] float32 through the native kernel (or the reference)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features).float().contiguous()
    lib = native_library()
    if lib is None:
        return gguf_matmul_ref(x2, w).reshape(*lead, w.out_features)
    m, k = x2.shape
    xq = torch.empty(m, k, dtype=torch.int8)
    dx = torch.empty(m, k // 32, dtype=torch.float32)
    fx = torch.empty(m, k // 16, dtype=torch.float32)
    lib.tf_quantize_activations(_ptr(x2), ctypes.c_int64(m), ctypes.c_int64(k), _ptr(xq), _ptr(dx), _ptr(fx))
    out = torch.empty(m, w.out_features, dtype=torch.float32)
    minv = _ptr(w.minv) if w.has_min else ctypes.c_void_p(None)
    lib.tf_gguf_matmul(ctypes.c_int(w.kind), _ptr(w.q), _ptr(w.scale), minv, ctypes.c_int64(w.out_features),
                       ctypes.c_int64(k), _ptr(xq), _ptr(dx), _ptr(fx), ctypes.c_int64(m), _ptr(out))
    return out.reshape(*lead, w.out_features)


__all__ = ["gguf_matmul", "gguf_matmul_ref", "native_library", "quantize_activations_ref"]
