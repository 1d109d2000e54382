"""Mistral: the Llama decoder; its `sliding_window` (every layer) is parsed generically."""

from __future__ import annotations

from tokenforge.model.models.llama import LlamaForCausalLM
from tokenforge.model.registry import register


@register("MistralForCausalLM", model_type="mistral")
class MistralForCausalLM(LlamaForCausalLM):
    pass
