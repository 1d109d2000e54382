"""The training path of the Llama decoder: batched [B, S] sequences, causal SDPA, no KV cache.

In: hidden [B, S, H] and the layer's own modules. Out: the layer's output [B, S, H] (the residual
stream, with the residual add done here rather than fused into the next norm).

It reads the very parameters the serving path reads, but runs plain differentiable torch ops
(`F.linear`, the fp32-variance RMSNorm, rotate-half rotary, SDPA): the Triton kernels and GEMVs
of the serving path have no backward. Numerics match the serving path's torch fallback (and HF):
norms in fp32 rounded to the model dtype, cos/sin rounded to the model dtype.

Linears are called as modules: the dense method runs F.linear on these [B, S, H] inputs, and a
LoRA hook in a linear's `lora` slot (model/layers/lora.py) adds its delta there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def train_linear(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x [..., in] -> [..., out]: the base projection plus a LoRA delta when one is attached."""
    return linear(x)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D], cos/sin [S, 1, D/2] -> x rotated (HF rotate_half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attention_train(attn: nn.Module, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """attn: a LlamaAttention; positions [S]; x [B, S, H] (normed) -> o_proj output [B, S, H]."""
    b, s, _ = x.shape
    qkv = train_linear(attn.qkv_proj, x)                         # [B, S, (Hq + 2 Hkv) D]
    q, k, v = qkv.split([attn.qkv_proj.q_size, attn.qkv_proj.kv_size, attn.qkv_proj.kv_size], dim=-1)
    q = q.view(b, s, attn.num_heads, attn.head_dim)
    k = k.view(b, s, attn.num_kv_heads, attn.head_dim)
    v = v.view(b, s, attn.num_kv_heads, attn.head_dim)
    cos, sin = attn.rotary_emb.cos_sin_cache[positions].to(x.dtype).unsqueeze(1).chunk(2, dim=-1)
    q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)     # [B, H, S, D]
    groups = attn.num_heads // attn.num_kv_heads
    if groups > 1:
        # Expanded K/V keep SDPA on its flash path on every torch version (GQA support varies).
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.attn.scale)   # [B, Hq, S, D]
    return train_linear(attn.o_proj, out.transpose(1, 2).reshape(b, s, -1))


def decoder_layer_train(layer: nn.Module, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """One pre-norm block: h = x + attn(norm(x)); out = h + mlp(norm(h)). hidden [B, S, H]."""
    h = hidden + attention_train(layer.self_attn, positions, layer.input_layernorm._norm(hidden))
    mlp = layer.mlp
    gate, up = train_linear(mlp.gate_up_proj, layer.post_attention_layernorm._norm(h)).chunk(2, dim=-1)
    return h + train_linear(mlp.down_proj, F.silu(gate) * up)


def run_decoder_layer_train(layer: nn.Module, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The block, recomputed in the backward pass when `layer.activation_checkpointing` is set
    (non-reentrant, so it composes with FSDP2's hooks and torch.compile)."""
    if getattr(layer, "activation_checkpointing", False) and torch.is_grad_enabled():
        return checkpoint(decoder_layer_train, layer, positions, hidden, use_reentrant=False)
    return decoder_layer_train(layer, positions, hidden)
