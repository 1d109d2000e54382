"""fp8 e4m3 weights, one fp32 scale per output channel (s = amax / 448), two ways to run them.

- `Fp8Method` (`--quantization fp8`, W8A8, CUDA sm90+): activations quantized per token
  (dynamic) or with a checkpoint's per-tensor scale (static), multiplied by torch._scaled_mm. Up
  to QGEMV_MAX_TOKENS rows take the weight-only GEMV instead (activations unquantized): those
  steps read weights only, and _scaled_mm pads them to a tile anyway. The products accumulate in
  the tensor cores' fast mode (no periodic promotion to fp32), as float8 inference usually runs
  (torchao's default): the per-token and per-channel scales are applied to fp32 sums either way.
- `Fp8SimMethod` (`--quantization fp8-sim`, any device, for quality tables): the weight is
  quantized and dequantized at load, each call quantizes and dequantizes the activations per
  token, then a dense float matmul.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenforge.kernels import quant_ops
from tokenforge.kernels.quant_gemv import dequantize_channel_ref
from tokenforge.kernels.quant_ops import FP8_MAX
from tokenforge.model.quant.base import install
from tokenforge.model.quant.dense import DenseMethod, become_dense
from tokenforge.model.quant.int8 import Int8Method
from tokenforge.model.quant.quantized import on_gpu


def quantize_fp8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (float8_e4m3fn [N, K], fp32 scale [N])."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp_min(1e-12)
    return (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


class Fp8Method(Int8Method):
    """`q_weight` e4m3 [N, K], `q_scale` fp32 [N] (and as a row, `q_scale_row` [1, N]),
    `q_input_scale` [1] for static activations or None for dynamic ones."""

    name = "fp8"
    kind = "fp8"

    @torch.no_grad()
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.install_codes(layer, *quantize_fp8_channel(layer.weight.detach()))

    def install_codes(self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor,
                      input_scale: torch.Tensor | None = None) -> None:
        install(layer, self, q_weight=q, q_scale=scale, q_scale_row=scale.view(1, -1), q_input_scale=input_scale)
        self.attach_plan(layer)

    def matmul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not x.is_cuda:
            raise ValueError("fp8 W8A8 runs on CUDA only (on the CPU use quantization='fp8-sim')")
        quantize = quant_ops.per_token_quant_fp8 if on_gpu(x) else quant_ops.per_token_quant_fp8_ref
        xq, x_scale = quantize(x, layer.q_input_scale)
        return torch._scaled_mm(xq, layer.q_weight.t(), scale_a=x_scale, scale_b=layer.q_scale_row,
                                bias=bias, out_dtype=x.dtype, use_fast_accum=True)


class Fp8SimMethod(DenseMethod):
    """The dequantized float weight (a dense layer's, packed on the CPU like one) and
    `q_input_scale` (None: per-token activation scales)."""

    name = "fp8-sim"

    @torch.no_grad()
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_fp8_channel(layer.weight.detach())
        self.install_dequantized(layer, dequantize_channel_ref(q, scale, torch.float32), None)

    def install_dequantized(self, layer: nn.Module, weight: torch.Tensor, input_scale: torch.Tensor | None) -> None:
        become_dense(layer, weight)
        layer.register_buffer("q_input_scale", input_scale, persistent=False)
        layer.quant_method = self

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, scale = quant_ops.per_token_quant_fp8_ref(x2, layer.q_input_scale)
        y = self.matmul(layer, (xq.float() * scale).to(x.dtype), bias)
        return y.reshape(*shape[:-1], y.shape[-1])

    def apply_normed(self, layer, x, residual, norm, bias):
        return None

    def apply_silu_mul(self, layer, gate_up, bias):
        return None


__all__ = ["Fp8Method", "Fp8SimMethod", "quantize_fp8_channel"]
