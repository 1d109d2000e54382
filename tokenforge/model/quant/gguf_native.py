"""GGUF weights computed in their stored block format on the CPU: the default there for a GGUF
model (`--dtype auto`); `--dtype float32` keeps the dequantized float path as the reference.

In: the loaded float model and, per linear, its GGUF tensors as stored (`StoredTensor`s from
model/loader/gguf_loader.py: q|k|v and gate|up in the layer's row order). `attach_gguf_native`
repacks each one losslessly (kernels/gguf_repack.py: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), undoes
llama.cpp's rotary row order of q/k by permuting packed rows, hands the layer to this method and
frees its float weight. A Q4_K_M file mixes types within one fused layer: neighbouring tensors of
one packed layout are concatenated, so such a layer runs one kernel call per layout. A layer with a
tensor of another type (F32, F16, Q2_K, Q3_K, IQ*, TQ*) keeps the dense float path (one log line per quantized
type names it and the native ones). The embedding lookup keeps its float table; a tied LM head
computes from token_embd's blocks.

apply: `gguf_matmul` (kernels/gguf_cpu.py): int8 activations per block of 32, integer dot
products on panels of 16 weight rows, float32 out, for up to `DEQUANTIZE_ROWS` rows (decode, short
prompts), and for longer prefill chunks too where the library has AVX-512 VNNI
(`long_chunk_dtype` int8, chosen once by `long_chunk_dtype_for_cpu`: W6's prefill shapes ran
1.3-1.5x oneDNN's bf16 GEMM there). Elsewhere a longer chunk dequantizes the layer into a reused
buffer and runs torch's GEMM in bfloat16 where the CPU multiplies bf16 natively (AVX512-BF16),
else float32, which is exactly the reference path's product (the row-at-a-time integer loops of
old took 3x as long as that GEMM on a 256-token window). Wherever the integer kernels run, the add
+ RMSNorm before q|k|v and gate|up and the SwiGLU before down are fused into the activation
quantization (`apply_normed`, `apply_silu_mul`: one native call each instead of ~10 torch ops).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenforge.kernels.gguf_cpu import (MAX_FUSED_ROW, dequantize_into, gguf_matmul, matmul_quantized,
                                         native_library, panels, repack_fast, rms_norm_quantize, silu_mul_quantize)
from tokenforge.kernels.gguf_repack import NATIVE_TYPES, PackedWeight, RowBlocks, cat_rows, dequantize_packed
from tokenforge.model.quant.base import QuantMethod, drop_weights

logger = logging.getLogger(__name__)

DEQUANTIZE_ROWS = 64
_SCRATCH = threading.local()        # each engine thread's buffers for a layer's dequantized weight
_FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}     # float already: the dense path is the stored format


def long_chunk_dtype_for_cpu() -> torch.dtype:
    """How prefill chunks longer than DEQUANTIZE_ROWS multiply: torch.int8 (8-bit activations and
    the integer panel kernels, as shorter chunks) where the native library has AVX-512 VNNI (W6's
    prefill shapes, one Zen-4 core: 1.3-1.5x oneDNN's bf16 GEMM on the dequantized weight, with no
    dequantizing pass); else the dequantized weight in bfloat16 where the CPU has native bf16 dot
    products (AVX512-BF16), else float32 (emulated bf16 GEMMs are slower than float32 ones)."""
    lib = native_library()
    if lib is not None and lib.tf_has_avx512_vnni():
        return torch.int8
    return torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() else torch.float32


class GgufNativeMethod(QuantMethod):
    """`layer.gguf_weight`: the PackedWeights of one layer, one per run of a packed layout.
    `long_chunk_dtype`: chosen once, when the method is made (`gguf_native_method`, at the first
    GGUF load): int8, or the dtype of the dequantized GEMM above DEQUANTIZE_ROWS rows."""

    name = "gguf-native"

    def __init__(self, long_chunk_dtype: torch.dtype | None = None) -> None:
        self.long_chunk_dtype = long_chunk_dtype or long_chunk_dtype_for_cpu()

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        """float32 [out, in]: the blocks as the float path holds them."""
        return torch.cat([dequantize_packed(w) for w in layer.gguf_weight])

    def _dequantized_scratch(self, layer: nn.Module) -> torch.Tensor:
        """`dequantized` in long_chunk_dtype, written into this thread's reused buffer (prefill
        chunks, layer after layer)."""
        rows, cols = sum(w.out_features for w in layer.gguf_weight), layer.gguf_weight[0].in_features
        name = f"buf_{self.long_chunk_dtype}"
        buf = getattr(_SCRATCH, name, None)
        if buf is None or buf.numel() < rows * cols:
            buf = torch.empty(rows * cols, dtype=self.long_chunk_dtype)
            setattr(_SCRATCH, name, buf)
        out, row = buf[: rows * cols].view(rows, cols), 0
        for w in layer.gguf_weight:
            dequantize_into(w, out[row:row + w.out_features])
            row += w.out_features
        return out

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])                                         # [T, in]
        if x2.shape[0] > DEQUANTIZE_ROWS and self.long_chunk_dtype != torch.int8:
            out = F.linear(x2.to(self.long_chunk_dtype), self._dequantized_scratch(layer)).float()
            if bias is not None:
                out += bias
        else:
            parts = [gguf_matmul(x2, w) for w in layer.gguf_weight]
            out = self._finish(parts, bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])

    def apply_normed(self, layer, x, residual, norm, bias):
        """Add + RMSNorm computed and quantized in one native call, then the integer kernels."""
        lib = self._fusing(x, x.shape[-1])
        if lib is None or (residual is not None and residual.dtype != torch.float32):
            return None
        acts, residual = rms_norm_quantize(lib, x.contiguous(), None if residual is None else residual.contiguous(),
                                           norm.weight, norm.eps)
        return self._finish([matmul_quantized(lib, acts, w) for w in layer.gguf_weight], bias), residual

    def apply_silu_mul(self, layer, gate_up, bias):
        """SwiGLU computed and quantized in one native call, then the integer kernels."""
        lib = self._fusing(gate_up, gate_up.shape[-1] // 2)
        if lib is None:
            return None
        acts = silu_mul_quantize(lib, gate_up.contiguous())
        return self._finish([matmul_quantized(lib, acts, w) for w in layer.gguf_weight], bias)

    def _fusing(self, x: torch.Tensor, width: int):
        """The native library when this call takes a fused prologue (the integer kernels' sizes,
        float32), else None."""
        long = x.shape[0] > DEQUANTIZE_ROWS and self.long_chunk_dtype != torch.int8
        if x.dim() != 2 or long or x.dtype != torch.float32 or width > MAX_FUSED_ROW:
            return None
        return native_library()

    @staticmethod
    def _finish(parts: list[torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)        # [T, out]
        if bias is not None:
            out += bias
        return out


@functools.cache
def gguf_native_method() -> GgufNativeMethod:
    """The engine's one instance, made at the first GGUF load (its choice needs the native library,
    which a model without GGUF weights never builds)."""
    return GgufNativeMethod()


def _rotary_rows(rows: int, num_heads: int) -> torch.Tensor:
    """Row index taking llama.cpp's interleaved q/k rows to HF order (gguf_loader._unpermute)."""
    return torch.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(-1)


def packed_weights(tensors: list) -> list[PackedWeight]:
    """A layer's stored tensors -> its PackedWeights, neighbours of one layout concatenated. Rows
    are permuted and neighbours of one GGUF type joined on the raw blocks (the repack is row by
    row), so each run is repacked once: a third of the start-up the per-tensor way cost. The row
    layout is transient: each part is kept only as panels of 16 rows (gguf_repack.PackedWeight)."""
    runs: list[tuple[int, int, list[np.ndarray]]] = []          # (ggml type, in_features, raw row blocks)
    for t in tensors:
        raw = t.blocks.numpy()      # numpy: its copies of the file's rows run ~10x torch's uint8 ones here
        if t.rotary_heads:
            raw = raw[_rotary_rows(raw.shape[0], t.rotary_heads).numpy()]
        if runs and runs[-1][:2] == (t.ggml_type, t.in_features):
            runs[-1][2].append(raw)
        else:
            runs.append((t.ggml_type, t.in_features, [raw]))
    groups: list[list[RowBlocks]] = []
    for ggml_type, in_features, raws in runs:
        joined = torch.from_numpy(np.concatenate(raws) if len(raws) > 1 else np.ascontiguousarray(raws[0]))
        w = repack_fast(joined, ggml_type, in_features)
        if groups and groups[-1][0].kind == w.kind:
            groups[-1].append(w)
        else:
            groups.append([w])
    return [panels(cat_rows(g) if len(g) > 1 else g[0]) for g in groups]


def attach_gguf_native(model: nn.Module, stored: dict[str, list]) -> set[str]:
    """Give every linear (module name -> its StoredTensors) whose tensors all have a native type
    the GGUF method, freeing its float weight. Returns the GGUF names of the tensors whose float
    copy is no longer needed (a loader that runs this first skips dequantizing them; a tied LM
    head's blocks are the embedding's table, which stays)."""
    modules = dict(model.named_modules())
    skipped: dict[int, list[str]] = defaultdict(list)
    converted, freed, taken = 0, 0, set()
    method = gguf_native_method()
    for name, tensors in stored.items():
        other = [t for t in tensors if t.ggml_type not in NATIVE_TYPES]
        if other:
            for t in other:
                if t.ggml_type not in _FLOAT_TYPES:
                    skipped[t.ggml_type].append(t.name)
            continue
        layer = modules[name]
        weights = packed_weights(tensors)
        weight = layer._parameters.get("weight")
        tied = layer is getattr(model, "lm_head", None) and model.config.tie_word_embeddings
        if not tied:                                 # a tied head's weight is the embedding's table
            freed += 0 if weight is None else weight.numel() * weight.element_size()
            taken.update(t.name for t in tensors)
        drop_weights(layer)
        layer.weight = None
        layer.gguf_weight = weights
        layer.quant_method = method
        converted += 1
    for ggml_type, names in skipped.items():
        logger.warning("GGUF type %s (%d tensors, e.g. %s) has no native CPU kernel (native: %s): those linears "
                       "run dequantized to float32", type_label(ggml_type), len(names), names[0],
                       ", ".join(NATIVE_TYPES.values()))
    logger.info("GGUF blocks computed as stored on the CPU: %d linears (%.0f MB of float weights not kept)",
                converted, freed / 1e6)
    return taken


def type_label(ggml_type: int) -> str:
    try:
        import gguf  # noqa: PLC0415 - names only

        return gguf.GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"ggml type {ggml_type}"


__all__ = ["DEQUANTIZE_ROWS", "GgufNativeMethod", "gguf_native_method", "attach_gguf_native", "long_chunk_dtype_for_cpu", "packed_weights"]
