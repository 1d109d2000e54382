"""Model families, one module each; importing this package registers them (registry.py).

Adding a family: a module here with its `@register(...)` class, and its import below (the order
of the imports is the order `supported_architectures` lists).
"""

from __future__ import annotations

from torch import nn

from tokenforge.model.models import llama, mistral, qwen2, qwen3  # noqa: F401, I001 - registers the dense families
from tokenforge.model.models import mixtral, qwen3_moe, qwen2_moe, gpt_oss  # noqa: F401, I001 - and the MoE families
from tokenforge.model.models.llama import LlamaForCausalLM
from tokenforge.model.registry import get_spec


def get_model_class(architecture: str) -> type[nn.Module]:
    return get_spec(architecture).model_class


__all__ = ["LlamaForCausalLM", "get_model_class"]
