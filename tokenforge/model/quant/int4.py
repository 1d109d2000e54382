"""int4 weight-only, asymmetric min-max per group of G inputs: q = round(w / s) + z in [0, 15],
s = (max - min) / 15 and z rounded to an integer, both stored in the model dtype (z exactly),
packed two per byte (kernels/quant_gemv.py's layout; the int4 checkpoint formats convert into it).

On the CPU int4 is simulated: the weight is dequantized back in place at load and the layer runs
dense (the numerics of the quantized model, the speed and memory of the float one).

Calibrated int4 (`--quantization-calibration`): calibrate.py leaves each layer GPTQ codes
(gptq.py) in the same format, installed instead of round-to-nearest ones.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenforge.kernels import quant_ops
from tokenforge.kernels.quant_gemv import QUANT_INT4, dequantize_int4_ref, pack_int4
from tokenforge.model.quant.base import install
from tokenforge.model.quant.dense import become_dense
from tokenforge.model.quant.quantized import QuantizedMethod, on_gpu


def quantize_int4_groups(w: torch.Tensor, group: int, dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (uint8 [N, K/2], scale [N, K/G], zero [N, K/G]); scales in dtype."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-8).to(dtype).float()     # the rounded scale quantizes
    zero = (-lo / scale).round().clamp(0, 15)
    q = (wg / scale[..., None]).round().add_(zero[..., None]).clamp_(0, 15).to(torch.uint8)
    return pack_int4(q.reshape(n, k)), scale.to(dtype), zero.to(dtype)


def check_group_size(k: int, group: int, name: str) -> None:
    if k % group:
        raise ValueError(f"int4 group size {group} does not divide the input size {k} of {name} (per "
                         f"tensor-parallel rank): choose a group size that divides it, e.g. {math.gcd(k, group)}")


class Int4Method(QuantizedMethod):
    """`q_weight` uint8 [N, K/2], `q_scale` and `q_zero` [N, K/G] in the model dtype."""

    name = "int4"
    kind = "int4"
    quant = QUANT_INT4

    def __init__(self, group_size: int = 128) -> None:
        self.group_size = group_size

    def check(self, layer: nn.Module, name: str) -> None:
        check_group_size(layer.in_features, self.group_size, name)
        super().check(layer, name)

    @torch.no_grad()
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Round-to-nearest, or the GPTQ codes calibration left on the layer (calibrate.py)."""
        codes = layer.__dict__.pop("calibrated_int4", None)
        if codes is None:
            w = layer.weight.detach()
            codes = quantize_int4_groups(w, self.group_size, w.dtype)
        self.install_packed(layer, *codes)

    def install_packed(self, layer: nn.Module, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """Take the layer over with packed codes, scales and zeros (or, on the CPU, their dequantized
        float weight)."""
        if packed.device.type == "cpu":
            become_dense(layer, dequantize_int4_ref(packed, scale, zero, torch.float32))
        else:
            install(layer, self, q_weight=packed, q_scale=scale, q_zero=zero)
            self.attach_plan(layer)

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        if layer.q_weight is None:        # the split-K kernel's tile layout alone (kernel_plan.attach)
            return quant_ops.dequantize_int4_tiles(layer.q_words, layer.q_scale_t, layer.q_zero_t, dtype,
                                                   self.group_size, layer.q_plan.tile)
        if on_gpu(layer.q_weight):
            return quant_ops.dequantize_int4(layer.q_weight, layer.q_scale, layer.q_zero, dtype, self.group_size)
        return dequantize_int4_ref(layer.q_weight, layer.q_scale, layer.q_zero, dtype)


def install_int4(layer: nn.Module, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> None:
    """Unpacked codes [N, K] with scales and zeros [N, >= K/G] -> the int4 method's format."""
    dtype = layer.params_dtype
    scale, zero = scale[:, : zero.shape[1]].to(dtype).contiguous(), zero.to(dtype).contiguous()
    Int4Method(group).install_packed(layer, pack_int4(q), scale, zero)


__all__ = ["Int4Method", "check_group_size", "install_int4", "quantize_int4_groups"]
