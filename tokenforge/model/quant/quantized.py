"""What the formats with a packed weight share: one dispatch by the number of rows.

The layer holds `q_weight`, `q_scale` (and `q_zero`, `q_input_scale`) as buffers, in the
kernels' layout (kernels/quant_gemv.py); the subclasses say how to dequantize them.
- At most `QGEMV_MAX_TOKENS` rows on CUDA: the dequant-fused Triton GEMV, with the add + RMSNorm
  or SiLU-and-mul prologue fused where gemv.fuses_prologue says so.
- More rows: dequantize into a temporary and run cuBLAS (the GEMM's FLOPs dominate there); fp8
  W8A8 overrides `matmul` with per-token activations and torch._scaled_mm.
- The CPU (and `use_triton_kernels(False)`): the torch references, so tests check the numerics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenforge.kernels.gemv import fuses_prologue
from tokenforge.kernels.quant_gemv import NORM, PLAIN, QUANT_CHANNEL, SILU_MUL, qgemv
from tokenforge.model.layers.kernel_dispatch import triton_ops
from tokenforge.model.quant.base import QuantMethod

QGEMV_MAX_TOKENS = 4     # rows each program re-reads the packed weight for (from L2); see bench kernels --quant


def use_qgemv(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.shape[0] <= QGEMV_MAX_TOKENS and triton_ops(x.device) is not None


def on_gpu(x: torch.Tensor) -> bool:
    return triton_ops(x.device) is not None


class QuantizedMethod(QuantMethod):
    """`quant` is QUANT_CHANNEL or QUANT_INT4 for the GEMV kernels; `group_size` is int4's."""

    quant = QUANT_CHANNEL
    group_size = 128

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
                     group=self.group_size)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if use_qgemv(x):
            return self._gemv(layer, PLAIN, x, bias)[0]
        shape = x.shape
        y = self.matmul(layer, x.reshape(-1, shape[-1]), bias)
        return y.reshape(*shape[:-1], y.shape[-1])

    def apply_normed(self, layer, x, residual, norm, bias):
        if not use_qgemv(x) or not fuses_prologue(layer.q_weight.shape[0], x.shape[1]):
            return None
        y, new_residual = self._gemv(layer, NORM, x, bias, residual, norm)
        return y, (new_residual if new_residual is not None else x)

    def apply_silu_mul(self, layer, gate_up, bias):
        if not use_qgemv(gate_up) or not fuses_prologue(layer.q_weight.shape[0], gate_up.shape[1] // 2):
            return None
        return self._gemv(layer, SILU_MUL, gate_up, bias)[0]


__all__ = ["QGEMV_MAX_TOKENS", "QuantizedMethod", "on_gpu", "use_qgemv"]
