"""Pre-quantized HF checkpoints: detect the scheme in config.json, give each linear the
checkpoint's parameters before loading, and convert them to the kernels' format after.

Supported (`quantization_config` in config.json):
- compressed-tensors `float-quantized`: fp8 e4m3 weights with per-tensor or per-channel scales,
  activations dynamic per token, static per tensor (`input_scale`), or none (weight-only);
- compressed-tensors `pack-quantized` W4A16: int4 groups, symmetric or asymmetric, eight values
  per int32 word (value + 8, element j at bits 4j), zero points packed along the output dim;
- AWQ `gemm`: qweight int32 [K, N/8] and qzeros [K/G, N/8] with the nibble order
  0, 2, 4, 6, 1, 3, 5, 7, scales [K/G, N]; w = (q - z) * s.
Every parameter declares its output / input dims and pack factors, so the layers' weight loaders
slice it per tensor-parallel rank. Anything else is refused with the scheme's name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from tokenforge.kernels.quant_gemv import dequantize_channel_ref, dequantize_int4_ref, pack_int4
from tokenforge.model.layers.linear import RowParallelLinear
from tokenforge.model.layers.parallel import _without_cycle
from tokenforge.model.quant.methods import ChannelWeightOnly, Fp8Simulated, Fp8W8A8, Int4Group
from tokenforge.model.quant.quantize import check_group_size, install, quantizable_layers

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)     # nibble i of a word holds column _AWQ_ORDER[i] of its 8


@dataclass(frozen=True, slots=True)
class CheckpointScheme:
    kind: str                     # ct-fp8 | ct-w4a16 | awq
    label: str                    # for logs and errors
    group_size: int = 0
    symmetric: bool = True
    weight_strategy: str = "channel"     # fp8: tensor | channel
    activations: str | None = None       # fp8: dynamic | static | None (weight-only)
    ignore: tuple[str, ...] = field(default_factory=tuple)

    def ignores(self, hf_name: str) -> bool:
        return any(re.fullmatch(p[3:], hf_name) if p.startswith("re:") else p == hf_name for p in self.ignore)


def _unsupported(what: str) -> ValueError:
    return ValueError(f"unsupported pre-quantized checkpoint: {what} (supported: compressed-tensors "
                      "float-quantized FP8 and pack-quantized W4A16, AWQ gemm)")


def detect(hf_config: dict) -> CheckpointScheme | None:
    """The checkpoint's scheme from config.json's quantization_config, or None for float weights."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "awq":
        return _awq(qc)
    raise _unsupported(f"quant_method {method!r}")


def _compressed_tensors(qc: dict) -> CheckpointScheme:
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise _unsupported(f"compressed-tensors with {len(groups)} config groups (one is supported)")
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
                raise _unsupported(label)
        else:
            raise _unsupported(label)
        return CheckpointScheme("ct-fp8", label, weight_strategy=w["strategy"], activations=acts, ignore=ignore)
    if fmt == "pack-quantized" and w.get("type") == "int" and w.get("num_bits") == 4 \
            and w.get("strategy") == "group" and a is None and not w.get("actorder"):
        return CheckpointScheme("ct-w4a16", label, group_size=int(w["group_size"]),
                                symmetric=bool(w.get("symmetric", True)), ignore=ignore)
    raise _unsupported(label)


def _awq(qc: dict) -> CheckpointScheme:
    version = str(qc.get("version", "gemm")).lower()
    label = f"awq {version}, {qc.get('bits')} bits, group {qc.get('group_size')}"
    if version != "gemm" or qc.get("bits", 4) != 4 or not qc.get("zero_point", True):
        raise _unsupported(label)
    return CheckpointScheme("awq", label, group_size=int(qc.get("group_size", 128)), symmetric=False,
                            ignore=tuple(qc.get("modules_to_not_convert") or ()))


# ---- before loading: the checkpoint's parameters on each linear ------------------------------------

def _hf_names(name: str) -> list[str]:
    """Our fused module name -> the checkpoint module names it is built from."""
    for fused, parts in ((".qkv_proj", ("q_proj", "k_proj", "v_proj")), (".gate_up_proj", ("gate_proj", "up_proj"))):
        if name.endswith(fused):
            return [name[: -len(fused)] + "." + p for p in parts]
    return [name]


def _ignored(scheme: CheckpointScheme, name: str) -> bool:
    if not scheme.ignore:
        return False
    flags = {scheme.ignores(n) or any(n.endswith("." + p) or n == p for p in scheme.ignore) for n in _hf_names(name)}
    if len(flags) > 1:
        raise _unsupported(f"{name}: some of its fused projections are quantized and some are not")
    return flags.pop()


def _param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, **dims) -> None:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=layer.q_device), requires_grad=False)
    for key, value in dims.items():
        setattr(p, key, value)
    p.weight_loader = _without_cycle(layer.weight_loader)
    layer.register_parameter(name, p)


def create_weights(layer: nn.Module, scheme: CheckpointScheme, name: str) -> None:
    """Register the checkpoint's tensors for this rank's shard (the float weight goes)."""
    n, k = layer.weight.shape
    shards = 1 if isinstance(layer, RowParallelLinear) else len(layer.shard_sizes())
    layer.q_dtype, layer.q_device = layer.weight.dtype, layer.weight.device
    g = scheme.group_size
    if g:
        check_group_size(k, g, name)
    del layer.weight
    if scheme.kind == "ct-fp8":
        _param(layer, "weight", (n, k), torch.float8_e4m3fn)
        if scheme.weight_strategy == "channel":
            _param(layer, "weight_scale", (n, 1), torch.float32, input_dim=None)
        else:
            _param(layer, "weight_scale", (shards,), torch.float32, per_shard=True)
        if scheme.activations == "static":
            _param(layer, "input_scale", (shards,), torch.float32, per_shard=True)
        return
    layer.weight = None
    if scheme.kind == "ct-w4a16":
        _param(layer, "weight_packed", (n, k // 8), torch.int32, input_pack=8)
        _param(layer, "weight_scale", (n, k // g), torch.float32, input_pack=g)
        _param(layer, "weight_shape", (2,), torch.int64, output_dim=None, input_dim=None)
        if not scheme.symmetric:
            _param(layer, "weight_zero_point", (n // 8, k // g), torch.int32, output_pack=8, input_pack=g)
    else:   # awq: [in, out] layouts
        _param(layer, "qweight", (k, n // 8), torch.int32, output_dim=1, input_dim=0, output_pack=8)
        _param(layer, "qzeros", (k // g, n // 8), torch.int32, output_dim=1, input_dim=0, output_pack=8, input_pack=g)
        _param(layer, "scales", (k // g, n), torch.float32, output_dim=1, input_dim=0, input_pack=g)


def prepare_model(model: nn.Module, scheme: CheckpointScheme) -> list[tuple[str, nn.Module]]:
    """Give every quantized linear the checkpoint's parameters; returns those layers."""
    layers = [(n, m) for n, m in quantizable_layers(model, include_lm_head=False) if not _ignored(scheme, n)]
    for name, layer in layers:
        create_weights(layer, scheme, name)
    return layers


# ---- after loading: convert to the kernels' format -------------------------------------------------

def _unpack_int32(words: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8C]: nibble i of word c is element 8c + order[i]."""
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    nibbles = ((words[..., None] >> shifts) & 0xF).to(torch.uint8)          # [R, C, 8] by nibble
    out = torch.empty_like(nibbles)
    out[..., list(order)] = nibbles
    return out.reshape(words.shape[0], -1)


def _per_channel(layer: nn.Module, values: torch.Tensor) -> torch.Tensor:
    """Per-shard scalars [S] -> per output row [N] (fused layers have one scale per checkpoint tensor)."""
    sizes = [layer.weight.shape[0]] if isinstance(layer, RowParallelLinear) else layer.shard_sizes()
    return torch.cat([values[i].expand(size) for i, size in enumerate(sizes)]).float().contiguous()


def process_weights(layer: nn.Module, scheme: CheckpointScheme) -> None:
    """Convert the loaded checkpoint tensors into q_weight / q_scale / q_zero and a method."""
    dtype = layer.q_dtype
    gpu = layer.q_device.type == "cuda"
    if scheme.kind == "ct-fp8":
        scale = layer.weight_scale.reshape(-1) if scheme.weight_strategy == "channel" \
            else _per_channel(layer, layer.weight_scale)
        q = layer.weight.data
        in_scale = layer.input_scale.max().reshape(1) if scheme.activations == "static" else None
        if not gpu:          # the CPU simulates: float weights, fp8 activations per call
            method = Fp8Simulated() if scheme.activations else None
            install(layer, method, dtype, dequantize_channel_ref(q, scale, torch.float32), q_input_scale=in_scale)
        elif scheme.activations:
            install(layer, Fp8W8A8(), dtype, q_weight=q, q_scale=scale, q_scale_row=scale.view(1, -1),
                    q_input_scale=in_scale)
        else:
            install(layer, ChannelWeightOnly(), dtype, q_weight=q, q_scale=scale)
        return
    if scheme.kind == "ct-w4a16":
        q = _unpack_int32(layer.weight_packed.data)                               # [N, K], value + 8
        scale = layer.weight_scale.data
        zero = (torch.full_like(scale, 8.0) if scheme.symmetric
                else _unpack_int32(layer.weight_zero_point.data.t().contiguous()).t().float())
    else:
        q = _unpack_int32(layer.qweight.data, _AWQ_ORDER).t().contiguous()        # [N, K]
        zero = _unpack_int32(layer.qzeros.data, _AWQ_ORDER).t().float()           # [N, K/G]
        scale = layer.scales.data.t()
    _install_int4(layer, q, scale[:, : zero.shape[1]], zero, scheme.group_size, dtype, gpu)


def _install_int4(layer: nn.Module, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                  dtype: torch.dtype, gpu: bool) -> None:
    packed = pack_int4(q)
    scale, zero = scale.to(dtype).contiguous(), zero.to(dtype).contiguous()
    if not gpu:
        install(layer, None, dtype, dequantize_int4_ref(packed, scale, zero, torch.float32))
    else:
        install(layer, Int4Group(), dtype, q_weight=packed, q_scale=scale, q_zero=zero, group_size=group)


def finish_model(layers: list[tuple[str, nn.Module]], scheme: CheckpointScheme) -> None:
    for _, layer in layers:
        process_weights(layer, scheme)


__all__ = ["CheckpointScheme", "create_weights", "detect", "finish_model", "prepare_model", "process_weights"]
