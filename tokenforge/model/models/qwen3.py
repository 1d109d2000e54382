"""Qwen3: the Llama decoder plus an RMSNorm over each query and key head (q_norm, k_norm, one
weight of head_dim each), applied before rotary. No q/k/v bias unless config.json asks for it;
a sliding window as in Qwen2 (`use_sliding_window`, from `max_window_layers` on)."""

from __future__ import annotations

import torch

from tokenforge.model.arch_config import ArchConfig, qwen_sliding_window_fields
from tokenforge.model.layers import RMSNorm, RotaryEmbedding
from tokenforge.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from tokenforge.model.registry import register


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, layer_idx: int, dtype: torch.dtype | None,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__(cfg, rotary, layer_idx, dtype, tp_rank, tp_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def attention(self, positions: torch.Tensor, qkv: torch.Tensor, pending=None) -> torch.Tensor:
        q, k, v = self.split_heads(qkv)
        # the head norms run in the rotary launch where the Triton path takes it (before rotary either way)
        return self.attn.forward_with_rotary(positions, q, k, v, self.rotary_emb, head_norms=(self.q_norm, self.k_norm),
                                             pending=pending)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


@register("Qwen3ForCausalLM", model_type="qwen3", config_extras=qwen_sliding_window_fields)
class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer = Qwen3DecoderLayer
