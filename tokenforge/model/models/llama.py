"""Llama: the dense decoder layer the other families reuse (Mistral and Qwen2 are specs on it,
Qwen3 adds q/k norms to its attention).

A layer is attention and a SwiGLU MLP, each after an RMSNorm. The residual stream is carried
separately so each norm fuses the add before it, and runs inside the projection after it (one
GEMV at decode sizes on CUDA); training runs the same code on the torch layers.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenforge.model.arch_config import ArchConfig
from tokenforge.model.attention.spec import AttentionSpec
from tokenforge.model.layers import (
    Attention,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
)
from tokenforge.model.layers.linear import add_pending
from tokenforge.model.models.decoder import CheckpointedLayer, DecoderForCausalLM
from tokenforge.model.registry import register

LLAMA_PACKED_MODULES = {
    "qkv_proj": {"q_proj": "q", "k_proj": "k", "v_proj": "v"},
    "gate_up_proj": {"gate_proj": 0, "up_proj": 1},
}


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, layer_idx: int, dtype: torch.dtype | None,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, cfg.attention_bias, dtype, tp_rank, tp_size)
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, cfg.o_proj_bias, dtype, tp_rank, tp_size)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.rotary_emb = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim ** -0.5, layer_idx,
                              spec=AttentionSpec(cfg.sliding_window_of(layer_idx)))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden))

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (Hq + 2 Hkv) * D] -> q [T, Hq, D], k and v [T, Hkv, D]."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        return (q.view(num_tokens, self.num_heads, self.head_dim), k.view(num_tokens, self.num_kv_heads, self.head_dim),
                v.view(num_tokens, self.num_kv_heads, self.head_dim))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) * D], the projection's output -> o_proj output [T, H]."""
        return self.o_proj(self.attention(positions, qkv))

    def attend_deferred(self, positions: torch.Tensor, qkv: torch.Tensor, pending=None):
        """attend, where qkv may still owe its LoRA delta (`pending`, added in the rotary launch) and
        o_proj's may be left for the norm after (Linear.forward_deferred): (o_proj output [T, H],
        delta or None)."""
        if pending is not None and not self.attn.adds_qkv_delta(qkv):
            qkv, pending = add_pending(qkv, pending), None
        return self.o_proj.forward_deferred(self.attention(positions, qkv, pending))

    def attention(self, positions: torch.Tensor, qkv: torch.Tensor, pending=None) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) * D] -> the heads' attention output [T, Hq * D] (o_proj's input)."""
        q, k, v = self.split_heads(qkv)
        return self.attn.forward_with_rotary(positions, q, k, v, self.rotary_emb, pending=pending)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype | None, tp_rank: int, tp_size: int,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size      # another width: a shared expert (Qwen2-MoE)
        bias = cfg.mlp_bias and intermediate_size is None
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], bias, dtype, tp_rank, tp_size)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias, dtype, tp_rank, tp_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor, pending=None) -> torch.Tensor:
        """gate_up [T, 2I] -> down_proj(silu(gate) * up) [T, H], fused at decode sizes; `pending`:
        gate_up's LoRA delta, left by its projection for the activation to add."""
        return self.down_proj.forward_silu_mul(self.act_fn, gate_up, pending)


class LlamaDecoderLayer(CheckpointedLayer):
    attention_class: type[nn.Module] = LlamaAttention

    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, layer_idx: int, dtype: torch.dtype | None,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = self.attention_class(cfg, rotary, layer_idx, dtype, tp_rank, tp_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, dtype, tp_rank, tp_size)

    def run(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] and the residual stream (None before the first layer) -> both after the layer."""
        attn = self.self_attn
        # a one-row step's LoRA deltas of qkv, o_proj and gate_up are added by the kernels after
        # them (rotary, the norm, the SwiGLU: kernels/lora_delta.py), not by launches of their own
        qkv, residual, pending = attn.qkv_proj.forward_normed_deferred(self.input_layernorm, hidden, residual, None)
        hidden, pending = attn.attend_deferred(positions, qkv, pending)
        gate_up, residual, pending = self.mlp.gate_up_proj.forward_normed_deferred(
            self.post_attention_layernorm, hidden, residual, pending)
        return self.mlp.down(gate_up, pending), residual


@register("LlamaForCausalLM", model_type="llama")
class LlamaForCausalLM(DecoderForCausalLM):
    decoder_layer = LlamaDecoderLayer
    packed_modules = LLAMA_PACKED_MODULES
