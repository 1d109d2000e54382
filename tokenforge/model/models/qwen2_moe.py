"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (q/k/v bias) with sparse MoE blocks on the layers
`decoder_sparse_step` / `mlp_only_layers` select, each adding a shared expert: a SwiGLU MLP of
`shared_expert_intermediate_size` that every token runs, scaled by sigmoid(shared_expert_gate(x)).
Routing as Qwen3-MoE (softmax, top k, renormalised under `norm_topk_prob`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tokenforge.model.arch_config import ArchConfig, config_int, qwen_sliding_window_fields
from tokenforge.model.layers.moe import Router, SparseMoeBlock
from tokenforge.model.layers.parallel import all_reduce
from tokenforge.model.models.llama import LLAMA_PACKED_MODULES, LlamaMLP
from tokenforge.model.models.moe import MoeDecoderLayer, MoeForCausalLM
from tokenforge.model.models.qwen3_moe import qwen3_moe_config_extras
from tokenforge.model.registry import register


def qwen2_moe_config_extras(cfg: dict[str, Any]) -> dict[str, Any]:
    fields = {**qwen3_moe_config_extras(cfg),       # HF's Qwen2-MoE rule: even layers below max_window_layers
              **qwen_sliding_window_fields(cfg, lambda i, c: i % 2 == 0 and i < config_int(c, "max_window_layers", 0, minimum=0))}
    shared = config_int(cfg, "shared_expert_intermediate_size", 0, minimum=0)
    return {**fields, "moe": dataclasses.replace(fields["moe"], shared_expert_intermediate_size=shared),
            "attention_bias": bool(cfg.get("qkv_bias", True))}


class SharedExpertMoeBlock(SparseMoeBlock):
    """The routed experts plus a shared expert every token runs: [T, H] -> [T, H]."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype | None, tp_rank: int, tp_size: int) -> None:
        super().__init__(cfg.hidden_size, cfg.moe, dtype, tp_rank, tp_size)
        self.shared_expert = LlamaMLP(cfg, dtype, tp_rank, tp_size,
                                      intermediate_size=cfg.moe.shared_expert_intermediate_size)
        self.shared_expert_gate = Router(cfg.hidden_size, 1, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.routed(x)
        routed = all_reduce(routed) if self.tp_size > 1 else routed
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen2MoeDecoderLayer(MoeDecoderLayer):
    @classmethod
    def build_sparse_mlp(cls, cfg: ArchConfig, dtype: torch.dtype | None, tp_rank: int, tp_size: int) -> SparseMoeBlock:
        if not cfg.moe.shared_expert_intermediate_size:
            return SparseMoeBlock(cfg.hidden_size, cfg.moe, dtype, tp_rank, tp_size)
        return SharedExpertMoeBlock(cfg, dtype, tp_rank, tp_size)


@register("Qwen2MoeForCausalLM", model_type="qwen2_moe", config_extras=qwen2_moe_config_extras)
class Qwen2MoeForCausalLM(MoeForCausalLM):
    decoder_layer = Qwen2MoeDecoderLayer
    packed_modules = LLAMA_PACKED_MODULES            # the dense layers' MLP and the shared experts

