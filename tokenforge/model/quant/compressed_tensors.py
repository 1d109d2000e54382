"""compressed-tensors checkpoints (llm-compressor's format, `quant_method: compressed-tensors`).

- `float-quantized` FP8 (`ct-fp8`): e4m3 weights with per-tensor or per-channel scales;
  activations dynamic per token, static per tensor (`input_scale`), or none (weight-only). On
  CUDA they run as fp8 W8A8 (fp8.py) or, weight-only, on the per-channel GEMV (int8.py); on the
  CPU as the dequantized float weight (with fp8-simulated activations when the scheme has them).
- `pack-quantized` W4A16 (`ct-w4a16`): int4 groups, symmetric or asymmetric, eight values per
  int32 word (value + 8, element j at bits 4j), zero points packed along the output dim; they
  run as int4 (int4.py).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenforge.kernels.quant_gemv import dequantize_channel_ref
from tokenforge.model.quant.base import QuantMethod, add_param, drop_weights
from tokenforge.model.quant.dense import become_dense
from tokenforge.model.quant.fp8 import Fp8Method, Fp8SimMethod
from tokenforge.model.quant.int4 import check_group_size, install_int4
from tokenforge.model.quant.int8 import Int8Method
from tokenforge.model.quant.scheme import CheckpointScheme, per_row, unpack_int32, unsupported


def parse(qc: dict) -> CheckpointScheme:
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise unsupported(f"compressed-tensors with {len(groups)} config groups (one is supported)")
    group, ignore = groups[0], tuple(qc.get("ignore") or ())
    fmt, w, a = group.get("format") or qc.get("format"), group.get("weights") or {}, group.get("input_activations")
    label = (f"compressed-tensors {fmt}: weights {w.get('type')}{w.get('num_bits')} {w.get('strategy')}, "
             f"activations {'none' if not a else a.get('type', '') + str(a.get('num_bits')) + ' ' + str(a.get('strategy'))}")
    if fmt == "float-quantized" and w.get("type") == "float" and w.get("num_bits") == 8 \
            and w.get("strategy") in ("tensor", "channel"):
        if a is None:
            acts = None
        elif a.get("type") == "float" and a.get("num_bits") == 8 and a.get("strategy") in ("token", "tensor"):
            acts = "dynamic" if a.get("dynamic") else "static"
            if acts == "static" and a.get("strategy") != "tensor":
                raise unsupported(label)
        else:
            raise unsupported(label)
        return CheckpointScheme("ct-fp8", label, weight_strategy=w["strategy"], activations=acts, ignore=ignore)
    if fmt == "pack-quantized" and w.get("type") == "int" and w.get("num_bits") == 4 \
            and w.get("strategy") == "group" and a is None and not w.get("actorder"):
        return CheckpointScheme("ct-w4a16", label, group_size=int(w["group_size"]),
                                symmetric=bool(w.get("symmetric", True)), ignore=ignore)
    raise unsupported(label)


class CompressedTensorsFp8(QuantMethod):
    """Loads `weight` (e4m3 [N, K]), `weight_scale` ([N, 1] per channel, or one per fused
    checkpoint tensor) and, for static activations, `input_scale` (one per checkpoint tensor)."""

    name = "ct-fp8"

    def __init__(self, scheme: CheckpointScheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: nn.Module) -> None:
        n, k, shards, device = layer.out_features, layer.in_features, len(layer.shard_sizes()), drop_weights(layer)
        add_param(layer, "weight", (n, k), torch.float8_e4m3fn, device)
        if self.scheme.weight_strategy == "channel":
            add_param(layer, "weight_scale", (n, 1), torch.float32, device, input_dim=None)
        else:
            add_param(layer, "weight_scale", (shards,), torch.float32, device, per_shard=True)
        if self.scheme.activations == "static":
            add_param(layer, "input_scale", (shards,), torch.float32, device, per_shard=True)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        s = self.scheme
        scale = layer.weight_scale.reshape(-1) if s.weight_strategy == "channel" else per_row(layer, layer.weight_scale)
        q = layer.weight.data
        in_scale = layer.input_scale.max().reshape(1) if s.activations == "static" else None
        if q.device.type != "cuda":          # the CPU simulates: float weights, fp8 activations per call
            weight = dequantize_channel_ref(q, scale, torch.float32)
            if s.activations:
                Fp8SimMethod().install_dequantized(layer, weight, in_scale)
            else:
                become_dense(layer, weight)
        elif s.activations:
            Fp8Method().install_codes(layer, q, scale, in_scale)
        else:
            Int8Method().install_codes(layer, q, scale)

    def apply(self, layer, x, bias):
        raise AssertionError("a compressed-tensors layer runs on the method it was converted to")


class CompressedTensorsW4A16(QuantMethod):
    """Loads `weight_packed` (int32 [N, K/8]), `weight_scale` [N, K/G], `weight_shape` and, when
    asymmetric, `weight_zero_point` (int32 [N/8, K/G])."""

    name = "ct-w4a16"

    def __init__(self, scheme: CheckpointScheme) -> None:
        self.scheme = scheme

    def check(self, layer: nn.Module, name: str) -> None:
        check_group_size(layer.in_features, self.scheme.group_size, name)

    def create_weights(self, layer: nn.Module) -> None:
        n, k, g, device = layer.out_features, layer.in_features, self.scheme.group_size, drop_weights(layer)
        layer.weight = None
        add_param(layer, "weight_packed", (n, k // 8), torch.int32, device, input_pack=8)
        add_param(layer, "weight_scale", (n, k // g), torch.float32, device, input_pack=g)
        add_param(layer, "weight_shape", (2,), torch.int64, device, output_dim=None, input_dim=None)
        if not self.scheme.symmetric:
            add_param(layer, "weight_zero_point", (n // 8, k // g), torch.int32, device, output_pack=8, input_pack=g)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q = unpack_int32(layer.weight_packed.data)                               # [N, K], value + 8
        scale = layer.weight_scale.data
        zero = (torch.full_like(scale, 8.0) if self.scheme.symmetric
                else unpack_int32(layer.weight_zero_point.data.t().contiguous()).t().float())
        install_int4(layer, q, scale, zero, self.scheme.group_size)

    def apply(self, layer, x, bias):
        raise AssertionError("a compressed-tensors layer runs on the method it was converted to")


__all__ = ["CompressedTensorsFp8", "CompressedTensorsW4A16", "parse"]
