"""What the formats with a packed weight share: one dispatch by the number of rows.

The layer holds `q_weight`, `q_scale` (and `q_zero`, `q_input_scale`) as buffers, in the
kernels' layout (kernels/quant_gemv.py); the subclasses say how to dequantize them. On CUDA,
`attach_plan` (at install) gives the layer a kernel_plan.KernelPlan: per decode row count up to
16, the backend (split-K kernel, the prologue-fused GEMV, tinygemm) chosen once from the measured
table, plus the buffers those kernels read.
- Decode rows on CUDA: the plan's backend; the add + RMSNorm or SiLU-and-mul prologue is fused
  where the backend is the GEMV and gemv.fuses_prologue says so.
- More rows (or the plan's `dense`): dequantize into a temporary and run cuBLAS (the GEMM's FLOPs
  dominate there); fp8 W8A8 overrides `matmul` with per-token activations and torch._scaled_mm.
- The CPU (and `use_triton_kernels(False)`): the torch references, so tests check the numerics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenforge.kernels import int4_tinygemm
from tokenforge.kernels.gemv import fuses_prologue
from tokenforge.kernels.quant_gemv import NORM, PLAIN, QUANT_CHANNEL, QUANT_INT4, SILU_MUL, qgemv
from tokenforge.kernels.quant_splitk import QUANT_FP8_A8, splitk_gemm
from tokenforge.model.layers.kernel_dispatch import triton_ops
from tokenforge.model.quant.base import QuantMethod
from tokenforge.model.quant.kernel_plan import Choice, attach, plan_for

QGEMV_MAX_TOKENS = 4     # rows each program re-reads the packed weight for (from L2); see bench kernels --quant


def use_qgemv(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.shape[0] <= QGEMV_MAX_TOKENS and triton_ops(x.device) is not None


def decode_choice(layer: nn.Module, x: torch.Tensor) -> Choice | None:
    """The plan's kernel for x's rows on CUDA, or None (the many-row path or the CPU)."""
    plan = getattr(layer, "q_plan", None)
    if plan is None or x.dim() != 2 or triton_ops(x.device) is None:
        return Choice("qgemv") if plan is None and use_qgemv(x) else None
    return plan.choice(x.shape[0])


def on_gpu(x: torch.Tensor) -> bool:
    return triton_ops(x.device) is not None


class QuantizedMethod(QuantMethod):
    """`quant` is QUANT_CHANNEL or QUANT_INT4 for the GEMV kernels; `group_size` is int4's."""

    quant = QUANT_CHANNEL
    group_size = 128
    kind = "int8"        # the kernel table's name for this weight format

    def check(self, layer: nn.Module, name: str) -> None:
        # on any device, so a forced kernel that cannot run a shape fails the same everywhere
        plan_for(self.kind, layer.out_features, layer.in_features, self.group_size, name)

    def attach_plan(self, layer: nn.Module) -> None:
        """At install, on CUDA: choose the layer's decode kernels and give it their buffers."""
        if on_gpu(layer.q_weight):
            n, k = layer.q_weight.shape
            attach(layer, plan_for(self.kind, n, 2 * k if self.quant == QUANT_INT4 else k, self.group_size))

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

    def _decode(self, layer: nn.Module, choice: Choice, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if choice.backend == "qgemv":
            return self._gemv(layer, PLAIN, x, bias)[0]
        if choice.backend == "tinygemm":
            return int4_tinygemm.matmul(x, layer.q_tg_weight, layer.q_tg_sz, self.group_size, bias)
        if self.quant == QUANT_INT4:
            return splitk_gemm(QUANT_INT4, x, layer.q_words, layer.q_scale_t, layer.q_zero_t, bias, self.group_size,
                               choice.config, layer.q_counter)
        return splitk_gemm(QUANT_FP8_A8 if choice.a8 else QUANT_CHANNEL, x, layer.q_weight, layer.q_scale, None, bias,
                           config=choice.config, counters=layer.q_counter)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        choice = decode_choice(layer, x)
        if choice is not None:
            return self._decode(layer, choice, x, bias)
        shape = x.shape
        y = self.matmul(layer, x.reshape(-1, shape[-1]), bias)
        return y.reshape(*shape[:-1], y.shape[-1])

    def _fuses(self, layer: nn.Module, x: torch.Tensor, k: int) -> bool:
        choice = decode_choice(layer, x)
        return choice is not None and choice.backend == "qgemv" and fuses_prologue(layer.q_weight.shape[0], k)

    def apply_normed(self, layer, x, residual, norm, bias):
        if not self._fuses(layer, x, x.shape[1]):
            return None
        y, new_residual = self._gemv(layer, NORM, x, bias, residual, norm)
        return y, (new_residual if new_residual is not None else x)

    def apply_silu_mul(self, layer, gate_up, bias):
        if not self._fuses(layer, gate_up, gate_up.shape[1] // 2):
            return None
        return self._gemv(layer, SILU_MUL, gate_up, bias)[0]


__all__ = ["QGEMV_MAX_TOKENS", "QuantizedMethod", "decode_choice", "on_gpu", "use_qgemv"]
