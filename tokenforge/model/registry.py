"""The model registry: HF architecture names -> ModelSpec.

A model family registers its causal-LM class once:

    @register("LlamaForCausalLM", model_type="llama")
    class LlamaForCausalLM(DecoderForCausalLM): ...

In: an HF config.json dict (or an architecture name). Out: the family's `ModelSpec`: the class to
build, the config extras it parses (`config_extras(cfg) -> ArchConfig field overrides`), its packed
modules (fused parameter -> checkpoint tensors with their shard ids, declared once on the class),
and its parameter count, from a build on the meta device (nothing allocated). An architecture
that no family registered gets one line naming it and the supported list, before anything loads.

The families live in `tokenforge.model.models`; that package is imported on first lookup (the
classes import this module for `register`, so this module does not import them at the top).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_MODELS_PACKAGE = "tokenforge.model.models"
_SPECS: dict[str, ModelSpec] = {}


def no_extras(cfg: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    architecture: str                       # the HF name, e.g. "Qwen3ForCausalLM"
    model_type: str                         # config.json's model_type, e.g. "qwen3"
    model_class: type[nn.Module]
    config_extras: Callable[[dict[str, Any]], dict[str, Any]] = no_extras
    packed_modules: dict[str, dict[str, Any]] = field(default_factory=dict)

    def build(self, config: Any, **kwargs: Any) -> nn.Module:
        return self.model_class(config, **kwargs)

    def num_parameters(self, config: Any) -> int:
        """As stored in a checkpoint (a tied lm_head counts once; a quantized weight counts its
        values), from a meta-device build."""
        return _count_parameters(self.model_class, config)

    def linear_values(self, config: Any) -> tuple[int, int]:
        """(weight values, output rows) of the linears an on-the-fly --quantization converts (every
        parallel linear: not the lm_head, the embedding, a MoE router or the expert stacks)."""
        return _count_linears(self.model_class, config)


@functools.lru_cache(maxsize=32)
def _count_parameters(model_class: type[nn.Module], config: Any) -> int:
    with torch.device("meta"):
        model = model_class(config)
    # shared (tied) parameters once; packed codes count the values they hold (MXFP4: two a byte, scales none)
    return sum(p.numel() * getattr(p, "values_per_element", 1) for p in model.parameters())


@functools.lru_cache(maxsize=32)
def _count_linears(model_class: type[nn.Module], config: Any) -> tuple[int, int]:
    with torch.device("meta"):
        model = model_class(config)
    lm_head = getattr(model, "lm_head", None)
    linears = [m for m in model.modules() if hasattr(m, "quant_method") and m is not lm_head]
    return sum(m.out_features * m.in_features for m in linears), sum(m.out_features for m in linears)


def register(architecture: str, *, model_type: str,
             config_extras: Callable[[dict[str, Any]], dict[str, Any]] = no_extras):
    """Class decorator: the class serves `architecture`; its `packed_modules` attribute names its
    fused parameters."""
    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        assert architecture not in _SPECS, f"{architecture} registered twice"
        _SPECS[architecture] = ModelSpec(architecture, model_type, cls, config_extras,
                                         dict(getattr(cls, "packed_modules", {})))
        return cls
    return wrap


def _specs() -> dict[str, ModelSpec]:
    importlib.import_module(_MODELS_PACKAGE)       # registers every family (once)
    return _SPECS


def supported_architectures() -> list[str]:
    return list(_specs())


def get_spec(architecture: str) -> ModelSpec:
    specs = _specs()
    if architecture not in specs:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: {', '.join(specs)}")
    return specs[architecture]


def spec_for_config(cfg: dict[str, Any]) -> ModelSpec:
    """The spec of an HF config.json dict: its first registered `architectures` entry, or (with
    no `architectures`) its `model_type`."""
    specs = _specs()
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in specs:
            return specs[arch]
    by_type = {s.model_type: s for s in specs.values()}
    if not archs and cfg.get("model_type") in by_type:
        return by_type[cfg["model_type"]]
    found = archs or [cfg.get("model_type")]
    raise ValueError(f"unsupported model architecture {found}; supported: {', '.join(specs)}")
