"""gpt-oss: attention with sinks (a learned logit per head in each softmax's denominator), a
sliding window on the layers `layer_types` marks (every other one), YaRN rope, biases on q/k/v/o,
and a sparse MoE block on every layer: top k of the router's logits, then a softmax over those k;
experts with biases and a clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`), whose checkpoint
interleaves the gate and up columns. The published checkpoints hold the experts in MXFP4
(`*_blocks` + `*_scales`, `quantization_config.quant_method` "mxfp4"), which stay 4-bit in memory;
a float checkpoint (as transformers saves one) stores them [E, in, out]."""

from __future__ import annotations

from typing import Any

import torch

from tokenforge.model.arch_config import ArchConfig, MoeConfig, config_float, config_int, quantization_method
from tokenforge.model.attention.spec import AttentionSpec
from tokenforge.model.layers import Attention, RotaryEmbedding, RowParallelLinear
from tokenforge.model.models.llama import LLAMA_PACKED_MODULES, LlamaAttention
from tokenforge.model.models.moe import MoeDecoderLayer, MoeForCausalLM, moe_config_fields
from tokenforge.model.registry import register


def gpt_oss_config_extras(cfg: dict[str, Any]) -> dict[str, Any]:
    quant = quantization_method(cfg)
    fields = moe_config_fields(
        cfg, intermediate_size=config_int(cfg, "intermediate_size"), routing="topk_softmax", activation="swiglu_oai",
        swiglu_alpha=config_float(cfg, "swiglu_alpha", 1.702), swiglu_limit=config_float(cfg, "swiglu_limit", 7.0),
        bias=True, interleaved_gate_up=True, expert_format="mxfp4" if quant == "mxfp4" else "dense")
    return {"moe": MoeConfig(**fields), "attention_bias": bool(cfg.get("attention_bias", True))}


class GptOssAttention(LlamaAttention):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, layer_idx: int, dtype: torch.dtype | None,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__(cfg, rotary, layer_idx, dtype, tp_rank, tp_size)
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, cfg.attention_bias, dtype, tp_rank, tp_size)
        spec = AttentionSpec(cfg.sliding_window_of(layer_idx), sinks=True)
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim ** -0.5, layer_idx,
                              spec=spec, tp_rank=tp_rank)


class GptOssDecoderLayer(MoeDecoderLayer):
    attention_class = GptOssAttention
    per_expert_shards = False              # one tensor per projection holds every expert


@register("GptOssForCausalLM", model_type="gpt_oss", config_extras=gpt_oss_config_extras)
class GptOssForCausalLM(MoeForCausalLM):
    decoder_layer = GptOssDecoderLayer
    packed_modules = {"qkv_proj": LLAMA_PACKED_MODULES["qkv_proj"]}
    renamed = ((".mlp.router.", ".mlp.gate."), (".self_attn.sinks", ".self_attn.attn.sinks"))
    expert_tensors = {
        ".experts.gate_up_proj": (".experts.w13_weight", "transposed"),      # [E, H, 2I]
        ".experts.down_proj": (".experts.w2_weight", "transposed"),          # [E, I, H]
        ".experts.gate_up_proj_bias": (".experts.w13_bias", "rows"),
        ".experts.down_proj_bias": (".experts.w2_bias", "rows"),
        ".experts.gate_up_proj_blocks": (".experts.w13_blocks", "rows"),     # [E, 2I, H/32, 16]
        ".experts.gate_up_proj_scales": (".experts.w13_scales", "rows"),     # [E, 2I, H/32]
        ".experts.down_proj_blocks": (".experts.w2_blocks", "rows"),         # [E, H, I/32, 16]
        ".experts.down_proj_scales": (".experts.w2_scales", "rows"),         # [E, H, I/32]
    }
