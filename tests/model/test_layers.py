"""Layer building blocks: tensor-parallel weight loaders (shards reassemble the full weight) and
rotary / norm numerics against HF."""

from __future__ import annotations

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from tokenforge.model.arch_config import ArchConfig
from tokenforge.model.layers import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabEmbedding,
)


def _load(param, tensor, shard_id=None):
    param.weight_loader(param, tensor, shard_id) if shard_id is not None else param.weight_loader(param, tensor)


def test_qkv_shards_reassemble_with_kv_replication():
    hidden, head_dim, heads, kv_heads, tp = 16, 4, 4, 1, 2     # 1 kv head, 2 ranks: replicated
    q, k, v = torch.randn(heads * head_dim, hidden), torch.randn(head_dim, hidden), torch.randn(head_dim, hidden)
    for rank in range(tp):
        layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=False, tp_rank=rank, tp_size=tp)
        for shard_id, w in (("q", q), ("k", k), ("v", v)):
            _load(layer.weight, w, shard_id)
        half = heads * head_dim // tp
        expected = torch.cat([q[rank * half:(rank + 1) * half], k, v])
        assert torch.equal(layer.weight.data, expected)


def test_merged_and_row_shards():
    gate, up, down = torch.randn(8, 6), torch.randn(8, 6), torch.randn(6, 8)
    x = torch.randn(3, 6)
    partial = torch.zeros(3, 6)
    for rank in range(2):
        merged = MergedColumnParallelLinear(6, [8, 8], tp_rank=rank, tp_size=2)
        _load(merged.weight, gate, 0)
        _load(merged.weight, up, 1)
        assert torch.equal(merged.weight.data, torch.cat([gate[rank * 4:(rank + 1) * 4], up[rank * 4:(rank + 1) * 4]]))
        row = RowParallelLinear(8, 6, tp_rank=rank, tp_size=2)
        _load(row.weight, down)
        # each rank's partial product; the all-reduce (not run here) sums them
        partial += torch.nn.functional.silu(x @ gate.T)[:, rank * 4:(rank + 1) * 4] @ row.weight.data.T
    torch.testing.assert_close(partial, torch.nn.functional.silu(x @ gate.T) @ down.T)


def test_vocab_embedding_last_rank_padding():
    full = torch.randn(10, 4)
    emb = VocabEmbedding(10, 4, tp_rank=2, tp_size=3)       # 4 rows per rank; rank 2 holds 8, 9 + padding
    _load(emb.weight, full)
    assert torch.equal(emb.weight.data[:2], full[8:]) and not emb.weight.data[2:].any()


def test_rotary_llama3_matches_hf():
    cfg = ArchConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10, "max_position_embeddings": 4096,
        "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}})
    hf_cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=4096, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    positions = torch.tensor([0, 1, 63, 64, 1000, 4095])
    q, k = torch.randn(6, 2, 64), torch.randn(6, 1, 64)
    ours = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
    oq, ok = ours(positions, q, k)
    cos, sin = LlamaRotaryEmbedding(hf_cfg)(q, positions[None])
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(oq, hq[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(ok, hk[0].transpose(0, 1), atol=0, rtol=0)


def test_rms_norm_matches_hf_with_fused_residual():
    for dtype in (torch.float32, torch.bfloat16):
        x, residual, weight = torch.randn(5, 32).to(dtype), torch.randn(5, 32).to(dtype), torch.randn(32).to(dtype)
        ours = RMSNorm(32, 1e-5, dtype)
        hf = LlamaRMSNorm(32, eps=1e-5).to(dtype)
        ours.weight.data.copy_(weight)
        hf.weight.data.copy_(weight)
        out, new_residual = ours(x, residual)
        assert torch.equal(new_residual, x + residual)
        assert torch.equal(out, hf(x + residual)) and torch.equal(ours(x), hf(x))
