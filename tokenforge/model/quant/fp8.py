"""fp8 e4m3 weights, one fp32 scale per output channel (s = amax / 448), two ways to run them.

- `Fp8Method` (`--quantization fp8`, W8A8, CUDA sm90+): activations quantized per token
  (dynamic) or with a checkpoint's per-tensor scale (static), multiplied by torch._scaled_mm; the
  quantization runs inside the kernel producing the activation (RMSNorm, SiLU-and-mul:
  quant_ops.rms_norm_quant_fp8 / silu_mul_quant_fp8), not as its own pass. Decode rows (<= 16)
  take the layer's kernel plan (kernel_plan.py): the split-K W8A8 kernel quantizes them in its
  prologue, the weight-only GEMV leaves them unquantized. The products accumulate in
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
from tokenforge.model.quant.quantized import decode_choice, on_gpu


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
        return self._scaled_mm(layer, xq, x_scale, bias, x.dtype)

    @staticmethod
    def _scaled_mm(layer: nn.Module, xq: torch.Tensor, x_scale: torch.Tensor, bias: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
        return torch._scaled_mm(xq, layer.q_weight.t(), scale_a=x_scale, scale_b=layer.q_scale_row,
                                bias=bias, out_dtype=dtype, use_fast_accum=True)

    def _many_rows(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """The _scaled_mm path, where the activation quantization fuses into its producer."""
        return x.dim() == 2 and on_gpu(x) and decode_choice(layer, x) is None

    def apply_normed(self, layer, x, residual, norm, bias):
        if not self._many_rows(layer, x):
            return super().apply_normed(layer, x, residual, norm, bias)
        xq, x_scale, new_residual = quant_ops.rms_norm_quant_fp8(x.contiguous(), residual, norm.weight, norm.eps,
                                                                 layer.q_input_scale)
        return self._scaled_mm(layer, xq, x_scale, bias, x.dtype), new_residual

    def apply_silu_mul(self, layer, gate_up, bias):
        if not self._many_rows(layer, gate_up):
            return super().apply_silu_mul(layer, gate_up, bias)
        xq, x_scale = quant_ops.silu_mul_quant_fp8(gate_up.contiguous(), layer.q_input_scale)
        return self._scaled_mm(layer, xq, x_scale, bias, gate_up.dtype)


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

    def apply_lora(self, layer, x, bias, lora, norm=None, residual=None, silu_mul=False, defer=False):
        return None         # the dense GEMV would skip the simulated activation quantization


__all__ = ["Fp8Method", "Fp8SimMethod", "quantize_fp8_channel"]
