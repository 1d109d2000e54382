"""CPU tests of the torch reference functions (the oracles the Triton kernels are tested against)."""

import pytest
import torch
import torch.nn.functional as F

from tokenforge.kernels.activation import silu_and_mul_ref
from tokenforge.kernels.kv_store import store_kv_ref
from tokenforge.kernels.paged_attention import decode_attention_ref, gather_kv, paged_attention_ref
from tokenforge.kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
from tokenforge.kernels.rotary import build_rope_cache, rope_inv_freq, rotary_ref

CPU = torch.device("cpu")


def _dense_causal(q_full: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA over one whole sequence; q [S, Hq, D], k/v [S, Hkv, D] -> [S, Hq, D]."""
    group = q_full.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(q_full.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("group", [1, 4])
def test_paged_ref_matches_dense_sdpa_without_context(paged_problem, group):
    q, kv, tables, qsl, seq_lens, _ = paged_problem([0, 0, 0], [5, 17, 33], 2 * group, 2, 16, 8, torch.float32, CPU)
    out = paged_attention_ref(q, kv, tables, qsl, seq_lens, 0.25)
    for i in range(3):
        s, e = int(qsl[i]), int(qsl[i + 1])
        k, v = gather_kv(kv, tables[i], int(seq_lens[i]))
        torch.testing.assert_close(out[s:e], _dense_causal(q[s:e], k, v, 0.25))


def test_paged_ref_with_context_matches_suffix_of_dense():
    """Queries starting mid-sequence (prefix hit / chunk) equal the tail rows of full attention."""
    torch.manual_seed(0)
    seq_len, ctx, bs = 45, 29, 8
    kv = torch.randn(2, 10, bs, 2, 16, dtype=torch.float32)
    table = torch.tensor([7, 2, 9, 0, 4, 1, 3], dtype=torch.int32)
    q_full = torch.randn(seq_len, 8, 16, dtype=torch.float32)
    k, v = gather_kv(kv, table, seq_len)
    dense = _dense_causal(q_full, k, v, 0.3)
    out = paged_attention_ref(q_full[ctx:], kv, table[None], torch.tensor([0, seq_len - ctx]),
                              torch.tensor([seq_len]), 0.3)
    torch.testing.assert_close(out, dense[ctx:])
    dec = decode_attention_ref(q_full[-1:], kv, table[None], torch.tensor([seq_len]), 0.3)
    torch.testing.assert_close(dec, dense[-1:])


def test_decode_ref_padding_row_is_zero():
    kv = torch.randn(2, 4, 8, 1, 16)
    out = decode_attention_ref(torch.randn(2, 2, 16), kv, torch.zeros(2, 2, dtype=torch.int32),
                               torch.tensor([0, 5]), 1.0)
    assert out[0].abs().max() == 0 and out[1].abs().max() > 0


def test_store_kv_ref_writes_exact_slots_and_skips_padding():
    kv = torch.zeros(2, 4, 4, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    store_kv_ref(k, v, kv, torch.tensor([5, -1, 14]))
    assert torch.equal(kv[0, 1, 1], k[0]) and torch.equal(kv[1, 3, 2], v[2])
    assert torch.equal(kv[0, 3, 2], k[2]) and torch.equal(kv[1, 1, 1], v[0])
    assert int((kv != 0).sum()) == 4 * 2 * 8                  # nothing else written


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def _hf_rotary(head_dim: int, base: float, scaling: dict | None):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    params = dict(scaling or {"rope_type": "default"}, rope_theta=base)
    cfg = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=131072, rope_parameters=params)
    return LlamaRotaryEmbedding(cfg)


@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_rope_cache_matches_hf_frequencies(scaling):
    emb = _hf_rotary(128, 500000.0, scaling)
    inv_freq = rope_inv_freq(128, 500000.0, scaling)
    torch.testing.assert_close(inv_freq.float(), emb.inv_freq.float(), rtol=1e-6, atol=0)
    cache = build_rope_cache(128, 3000, 500000.0, scaling)
    pos = torch.tensor([0, 1, 17, 2999])
    angles = pos[:, None].double() * inv_freq[None]
    torch.testing.assert_close(cache[pos], torch.cat([angles.cos(), angles.sin()], -1).float())


def test_rotary_ref_matches_hf_apply():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    emb = _hf_rotary(64, 10000.0, None)
    q, k = torch.randn(9, 4, 64), torch.randn(9, 2, 64)
    pos = torch.tensor([0, 1, 2, 7, 100, 5, 3, 2000, 11])
    cos, sin = emb(q, pos[None])                               # [1, T, D]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_ref, k_ref = rotary_ref(q, k, pos, build_rope_cache(64, 2048, 10000.0))
    torch.testing.assert_close(q_ref, q_hf[0].transpose(0, 1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_ref, k_hf[0].transpose(0, 1), atol=1e-4, rtol=1e-4)


def test_rms_norm_refs_match_hf():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    torch.nn.init.normal_(norm.weight)
    x, res = torch.randn(6, 64, dtype=torch.bfloat16), torch.randn(6, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(rms_norm_ref(x, norm.weight, 1e-5), norm(x))
        out, new_res = fused_add_rms_norm_ref(x, res, norm.weight, 1e-5)
        torch.testing.assert_close(new_res, x + res)
        torch.testing.assert_close(out, norm(x + res))


def test_silu_and_mul_ref():
    x = torch.randn(5, 2 * 24)
    expect = x[:, :24] * torch.sigmoid(x[:, :24]) * x[:, 24:]
    torch.testing.assert_close(silu_and_mul_ref(x), expect)
