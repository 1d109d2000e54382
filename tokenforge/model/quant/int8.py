"""int8 weight-only, per output channel: q = round(w / s), s = amax / 127, fp32 scales.

Activations stay in the model dtype. The same runtime serves fp8-stored per-channel weights
(a compressed-tensors FP8 checkpoint without activation quantization): the GEMV and the
dequantize kernels read int8 and e4m3 codes alike. On the CPU the torch references run (the
engine's CPU int8 is the dynamic one, cpu_int8.py).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenforge.kernels import quant_ops
from tokenforge.kernels.quant_gemv import dequantize_channel_ref
from tokenforge.model.quant.base import install
from tokenforge.model.quant.quantized import QuantizedMethod, on_gpu


def quantize_int8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], fp32 scale [N])."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / 127.0).clamp_min(1e-10)
    return (wf / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


class Int8Method(QuantizedMethod):
    """`q_weight` int8 (or e4m3) [N, K], `q_scale` fp32 [N]."""

    name = "int8"

    @torch.no_grad()
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.install_codes(layer, *quantize_int8_channel(layer.weight.detach()))

    def install_codes(self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor) -> None:
        install(layer, self, q_weight=q, q_scale=scale)
        self.attach_plan(layer)

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        if on_gpu(layer.q_weight):
            return quant_ops.dequantize_channel(layer.q_weight, layer.q_scale, dtype)
        return dequantize_channel_ref(layer.q_weight, layer.q_scale, dtype)


__all__ = ["Int8Method", "quantize_int8_channel"]
