"""Qwen2: the Llama decoder with q/k/v bias, which its config.json does not state, and a sliding
window only under `use_sliding_window`, from `max_window_layers` on."""

from __future__ import annotations

from typing import Any

from tokenforge.model.arch_config import qwen_sliding_window_fields
from tokenforge.model.models.llama import LlamaForCausalLM
from tokenforge.model.registry import register


def qwen2_config_extras(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": True, **qwen_sliding_window_fields(cfg)}


@register("Qwen2ForCausalLM", model_type="qwen2", config_extras=qwen2_config_extras)
class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
