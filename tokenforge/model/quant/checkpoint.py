"""Pre-quantized HF checkpoints: detect the scheme in config.json and, before loading, give each
quantized linear the method of its format (which registers the checkpoint's parameters for this
rank's shard). After loading, the methods convert them (see base.py).

Supported: compressed-tensors FP8 and W4A16 (compressed_tensors.py), AWQ gemm (awq.py), and MXFP4
experts (mxfp4.py: the MoE layers hold them; no linear changes). Anything
else is refused with the scheme's name. Modules the checkpoint lists as not converted stay dense.
"""

from __future__ import annotations

from torch import nn

from tokenforge.model.quant.base import linear_layers
from tokenforge.model.arch_config import quantization_method
from tokenforge.model.quant.mxfp4 import prepare_experts
from tokenforge.model.quant.registry import CHECKPOINT_FORMATS, CHECKPOINT_METHODS
from tokenforge.model.quant.scheme import CheckpointScheme, unsupported


def detect(hf_config: dict) -> CheckpointScheme | None:
    """The checkpoint's scheme from config.json's quantization_config, or None for float weights."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = quantization_method(hf_config)
    if method not in CHECKPOINT_FORMATS:
        raise unsupported(f"quant_method {method!r}")
    return CHECKPOINT_FORMATS[method](qc)


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
        raise unsupported(f"{name}: some of its fused projections are quantized and some are not")
    return flags.pop()


def create_weights(layer: nn.Module, scheme: CheckpointScheme, name: str) -> None:
    """Hand one linear to the scheme's method, which registers the checkpoint's tensors (the
    float weight goes)."""
    method = CHECKPOINT_METHODS[scheme.kind](scheme)
    method.check(layer, name)
    layer.quant_method = method
    method.create_weights(layer)


def prepare_model(model: nn.Module, scheme: CheckpointScheme) -> list[tuple[str, nn.Module]]:
    """Give every quantized linear the checkpoint's parameters; returns those layers."""
    if scheme.kind == "mxfp4":
        return prepare_experts(model)
    from tokenforge.model.layers.moe import FusedExperts  # noqa: PLC0415 - MoE models only

    experts = [n for n, m in model.named_modules() if isinstance(m, FusedExperts) and not _ignored(scheme, n)]
    if experts:        # their tensors would have nowhere to go (the fused MoE kernel reads float, fp8 or MXFP4)
        raise unsupported(f"{scheme.label} experts ({type(model).__name__}, {experts[0]}): the fused MoE kernel "
                          "takes bf16/fp16 or MXFP4 experts, or fp8 ones it quantizes itself; use the unquantized "
                          "checkpoint, with --quantization fp8 for fp8 experts")
    layers = [(n, m) for n, m in linear_layers(model) if not _ignored(scheme, n)]
    for name, layer in layers:
        create_weights(layer, scheme, name)
    return layers


__all__ = ["CheckpointScheme", "create_weights", "detect", "prepare_model"]
