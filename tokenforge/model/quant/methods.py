"""Runtime linear methods: how a quantized layer computes y = x W^T + b.

A method is stateless; the layer holds its tensors (`q_weight`, `q_scale`, `q_zero`,
`q_input_scale`, as buffers). Every method dispatches by the number of rows:
- at most `QGEMV_MAX_TOKENS` rows on CUDA: the dequant-fused Triton GEMV (kernels/quant_gemv.py),
  with the add + RMSNorm or SiLU-and-mul prologue fused where gemv.fuses_prologue says so;
- more rows: int8 / int4 / fp8 weight-only dequantize into a temporary and run cuBLAS (the GEMM's
  FLOPs dominate there); fp8 W8A8 quantizes the activations per token and runs torch._scaled_mm;
- the CPU (and `use_triton_kernels(False)`): the torch references, so tests check the numerics.
`apply_normed` / `apply_silu_mul` return None where they do not fuse, and the layer runs the
unfused modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenforge.kernels import quant_ops
from tokenforge.kernels.gemv import fuses_prologue
from tokenforge.kernels.quant_gemv import (NORM, PLAIN, QUANT_CHANNEL, QUANT_INT4, SILU_MUL, dequantize_channel_ref,
                                           dequantize_int4_ref, qgemv)
from tokenforge.model.layers.cpu_packed import packed_linear
from tokenforge.model.layers.kernel_dispatch import triton_ops

QGEMV_MAX_TOKENS = 4     # rows each program re-reads the packed weight for (from L2); see bench kernels --quant


def _use_qgemv(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.shape[0] <= QGEMV_MAX_TOKENS and triton_ops(x.device) is not None


def _on_gpu(x: torch.Tensor) -> bool:
    return triton_ops(x.device) is not None


class LinearMethod:
    """The interface. `quant` is QUANT_CHANNEL or QUANT_INT4 for the GEMV kernels."""

    name = "none"
    quant = QUANT_CHANNEL

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The layer's weight [N, K] in dtype (a temporary)."""
        raise NotImplementedError

    def matmul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The many-row path: x [T, K] -> [T, N]."""
        return F.linear(x, self.dequantize(layer, x.dtype), bias)

    def _gemv(self, layer: nn.Module, prologue: int, x: torch.Tensor, bias: torch.Tensor | None,
              residual: torch.Tensor | None = None, norm: nn.Module | None = None):
        return qgemv(prologue, self.quant, x, layer.q_weight, layer.q_scale, getattr(layer, "q_zero", None), bias,
                     residual, norm.weight if norm is not None else None, norm.eps if norm is not None else 0.0,
                     group=getattr(layer, "group_size", 128))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if _use_qgemv(x):
            return self._gemv(layer, PLAIN, x, bias)[0]
        shape = x.shape
        y = self.matmul(layer, x.reshape(-1, shape[-1]), bias)
        return y.reshape(*shape[:-1], y.shape[-1])

    def apply_normed(self, layer: nn.Module, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None):
        if not _use_qgemv(x) or not fuses_prologue(layer.q_weight.shape[0], x.shape[1]):
            return None
        y, new_residual = self._gemv(layer, NORM, x, layer.bias, residual, norm)
        return y, (new_residual if new_residual is not None else x)

    def apply_silu_mul(self, layer: nn.Module, act_fn: nn.Module, gate_up: torch.Tensor,
                       bias: torch.Tensor | None):
        if not _use_qgemv(gate_up) or not fuses_prologue(layer.q_weight.shape[0], gate_up.shape[1] // 2):
            return None
        return self._gemv(layer, SILU_MUL, gate_up, bias)[0]


class ChannelWeightOnly(LinearMethod):
    """int8 (or fp8-stored) weights, one fp32 scale per output row; activations stay in the
    model dtype."""

    name = "int8"

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        if _on_gpu(layer.q_weight):
            return quant_ops.dequantize_channel(layer.q_weight, layer.q_scale, dtype)
        return dequantize_channel_ref(layer.q_weight, layer.q_scale, dtype)


class Int4Group(LinearMethod):
    """uint8-packed 4-bit weights with a scale and a zero point per group of `group_size` inputs."""

    name = "int4"
    quant = QUANT_INT4

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        if _on_gpu(layer.q_weight):
            return quant_ops.dequantize_int4(layer.q_weight, layer.q_scale, layer.q_zero, dtype, layer.group_size)
        return dequantize_int4_ref(layer.q_weight, layer.q_scale, layer.q_zero, dtype)


class Fp8W8A8(ChannelWeightOnly):
    """e4m3 weights with per-channel scales, activations quantized per token (dynamic) or with
    the checkpoint's per-tensor scale (static), multiplied by torch._scaled_mm (Hopper). Up to
    QGEMV_MAX_TOKENS rows take the weight-only GEMV instead (activations unquantized): those
    steps read weights only, and _scaled_mm pads them to a tile anyway. The products accumulate in
    the tensor cores' fast mode (no periodic promotion to fp32), as float8 inference usually runs
    (torchao's default): the per-token and per-channel scales are applied to fp32 sums either way."""

    name = "fp8"

    def matmul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not x.is_cuda:
            raise ValueError("fp8 W8A8 runs on CUDA only (on the CPU use quantization='fp8-sim')")
        quantize = quant_ops.per_token_quant_fp8 if _on_gpu(x) else quant_ops.per_token_quant_fp8_ref
        xq, x_scale = quantize(x, layer.q_input_scale)
        return torch._scaled_mm(xq, layer.q_weight.t(), scale_a=x_scale, scale_b=layer.q_scale_row,
                                bias=bias, out_dtype=x.dtype, use_fast_accum=True)


class Fp8Simulated(LinearMethod):
    """fp8 W8A8 simulated for quality checks (the CPU): the weight was quantized and dequantized
    at load, each call quantizes and dequantizes the activations per token, then a float matmul."""

    name = "fp8-sim"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, scale = quant_ops.per_token_quant_fp8_ref(x2, layer.q_input_scale)
        xs = (xq.float() * scale).to(x.dtype)
        y = packed_linear(xs, layer.weight, bias, layer.packed_weight)
        return y.reshape(*shape[:-1], y.shape[-1])

    def apply_normed(self, layer, norm, x, residual):
        return None

    def apply_silu_mul(self, layer, act_fn, gate_up, bias):
        return None


__all__ = ["QGEMV_MAX_TOKENS", "ChannelWeightOnly", "Fp8Simulated", "Fp8W8A8", "Int4Group", "LinearMethod"]
