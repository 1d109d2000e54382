"""Mixtral: the Llama attention with a sparse MoE block on every layer (softmax over the experts,
the top k renormalised); its checkpoint names the block `block_sparse_moe` and one expert's
projections w1 (gate), w3 (up) and w2 (down)."""

from __future__ import annotations

from typing import Any

from tokenforge.model.arch_config import MoeConfig, config_int
from tokenforge.model.models.llama import LLAMA_PACKED_MODULES
from tokenforge.model.models.moe import MoeDecoderLayer, MoeForCausalLM, moe_config_fields
from tokenforge.model.registry import register


def mixtral_config_extras(cfg: dict[str, Any]) -> dict[str, Any]:
    fields = moe_config_fields(cfg, intermediate_size=config_int(cfg, "intermediate_size"), renormalize=True)
    return {"moe": MoeConfig(**fields)}


@register("MixtralForCausalLM", model_type="mixtral", config_extras=mixtral_config_extras)
class MixtralForCausalLM(MoeForCausalLM):
    decoder_layer = MoeDecoderLayer
    packed_modules = {"qkv_proj": LLAMA_PACKED_MODULES["qkv_proj"]}
    renamed = ((".block_sparse_moe.", ".mlp."),)
    expert_parts = {"w1": "gate", "w3": "up", "w2": "down"}
