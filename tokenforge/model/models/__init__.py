"""Model classes by HF architecture name."""

from __future__ import annotations

from torch import nn

from tokenforge.model.arch_config import SUPPORTED_ARCHITECTURES
from tokenforge.model.models.llama import LlamaForCausalLM

_REGISTRY: dict[str, type[nn.Module]] = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _REGISTRY:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: {', '.join(_REGISTRY)}")
    return _REGISTRY[architecture]


__all__ = ["LlamaForCausalLM", "get_model_class"]
