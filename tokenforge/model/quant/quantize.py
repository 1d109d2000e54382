"""On-the-fly weight quantization of a loaded float model, and installing quantized tensors.

In: a model whose linears hold this rank's float weights (loaded by the usual weight loaders, so
tensor parallelism composes). Out: each quantized linear holds `q_weight`, `q_scale` (and
`q_zero`, `q_input_scale`) buffers and a `quant_method`; its float `weight` is freed.

Formats (the kernels' layout; pre-quantized checkpoints are converted into the same):
- int8: symmetric per output channel, q = round(w / s), s = amax / 127, fp32 scales;
- fp8: e4m3 per output channel, s = amax / 448, fp32 scales;
- int4: asymmetric min-max per group of G inputs, q = round(w / s) + z in [0, 15],
  s = (max - min) / 15 and z rounded to an integer, both stored in the model dtype (z exactly),
  packed two per byte.
On the CPU only simulations run: int4 and fp8 weights are dequantized back in place (the
numerics of the quantized model, the speed and memory of the float one).
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from tokenforge.kernels.quant_gemv import dequantize_channel_ref, dequantize_int4_ref, pack_int4
from tokenforge.kernels.quant_ops import FP8_MAX
from tokenforge.model.layers.embedding import LMHead
from tokenforge.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from tokenforge.model.quant.methods import ChannelWeightOnly, Fp8Simulated, Fp8W8A8, Int4Group, LinearMethod

logger = logging.getLogger(__name__)


def quantize_int8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], fp32 scale [N])."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / 127.0).clamp_min(1e-10)
    return (wf / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def quantize_fp8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (float8_e4m3fn [N, K], fp32 scale [N])."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp_min(1e-12)
    return (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


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


def install(layer: nn.Module, method: LinearMethod | None, weight_dtype: torch.dtype,
            dequantized: torch.Tensor | None = None, **tensors: torch.Tensor | int | None) -> None:
    """Replace the layer's float weight with quantized buffers and a method. With `dequantized`
    (CPU simulation) the float weight becomes those values instead and `method` may be None."""
    for name in [n for n, _ in layer.named_parameters(recurse=False) if n != "bias"]:
        delattr(layer, name)
    if dequantized is not None:
        layer.weight = nn.Parameter(dequantized.to(weight_dtype), requires_grad=False)
    else:
        layer.weight = None
    for name, value in tensors.items():
        if isinstance(value, torch.Tensor) or value is None:
            layer.register_buffer(name, value, persistent=False)
        else:
            setattr(layer, name, value)
    if method is not None:
        layer.quant_method = method


def quantize_layer(layer: nn.Module, mode: str, group: int, name: str) -> None:
    """Quantize one linear in place (mode int8 | int4 | fp8 on CUDA; int4 | fp8-sim on the CPU)."""
    w = layer.weight.detach()
    dtype, cpu = w.dtype, w.device.type == "cpu"
    if mode == "int4":
        check_group_size(w.shape[1], group, name)
        packed, scale, zero = quantize_int4_groups(w, group, dtype)
        if cpu:
            install(layer, None, dtype, dequantize_int4_ref(packed, scale, zero, torch.float32))
        else:
            install(layer, Int4Group(), dtype, q_weight=packed, q_scale=scale, q_zero=zero, group_size=group)
    elif mode == "int8":
        q, scale = quantize_int8_channel(w)
        install(layer, ChannelWeightOnly(), dtype, q_weight=q, q_scale=scale)
    elif mode == "fp8":
        q, scale = quantize_fp8_channel(w)
        install(layer, Fp8W8A8(), dtype, q_weight=q, q_scale=scale, q_scale_row=scale.view(1, -1),
                q_input_scale=None)
    elif mode == "fp8-sim":
        q, scale = quantize_fp8_channel(w)
        install(layer, Fp8Simulated(), dtype, dequantize_channel_ref(q, scale, torch.float32), q_input_scale=None)
    else:
        raise ValueError(f"unknown quantization mode {mode!r}")


def quantizable_layers(model: nn.Module, include_lm_head: bool) -> list[tuple[str, nn.Module]]:
    """The linears a mode applies to: every parallel linear, plus the lm_head when asked."""
    kinds = (ColumnParallelLinear, RowParallelLinear) + ((LMHead,) if include_lm_head else ())
    return [(n, m) for n, m in model.named_modules() if isinstance(m, kinds)]


@torch.no_grad()
def quantize_model(model: nn.Module, mode: str, group: int = 128, include_lm_head: bool = False) -> int:
    """Quantize every linear of a loaded model; returns how many. Layer by layer, so the peak
    extra memory is one layer's float copy."""
    layers = quantizable_layers(model, include_lm_head)
    for name, layer in layers:                     # check every shape before changing any
        if mode == "int4":
            check_group_size(layer.weight.shape[1], group, name)
    for name, layer in layers:
        quantize_layer(layer, mode, group, name)
    if include_lm_head and getattr(model.config, "tie_word_embeddings", False):
        logger.info("--quantize-lm-head with tied embeddings: the embedding keeps its float copy")
    return len(layers)


__all__ = ["check_group_size", "install", "quantizable_layers", "quantize_fp8_channel", "quantize_int4_groups",
           "quantize_int8_channel", "quantize_layer", "quantize_model"]
