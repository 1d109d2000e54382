"""The torch paged attention backend against plain per-sequence attention over unpaged K/V."""

from __future__ import annotations

import random

import torch

from tokenforge.model.attention import (
    AttentionBatch,
    TorchAttentionBackend,
    get_attention_backend,
)
from tokenforge.model.forward_context import set_forward_context
from tokenforge.model.layers.attention import Attention

HQ, HKV, D, BS, NUM_BLOCKS = 6, 2, 8, 4, 64


def _reference(q, k, v, scale, context_len):
    """q [Lq, Hq, D] at positions context_len.., k/v [S, Hkv, D] for positions 0..S-1."""
    k = k.repeat_interleave(HQ // HKV, dim=1)
    v = v.repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(context_len, context_len + q.shape[0])
    scores.masked_fill_(torch.arange(k.shape[0])[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_mixed_batch_matches_reference():
    gen = torch.Generator().manual_seed(0)
    backend = get_attention_backend("torch", "cpu")
    assert backend.kv_cache_shape(NUM_BLOCKS, BS, HKV, D) == (2, NUM_BLOCKS, BS, HKV, D)
    cache = torch.zeros(2, NUM_BLOCKS, BS, HKV, D)
    free = list(range(NUM_BLOCKS))
    random.Random(0).shuffle(free)
    # (context_len, query_len): prefill, chunk after cached context, decodes of different lengths.
    shapes = [(0, 7), (1, 1), (9, 1), (5, 6), (12, 1), (0, 1)]
    full_k = [torch.randn(c + n, HKV, D, generator=gen) for c, n in shapes]
    full_v = [torch.randn(c + n, HKV, D, generator=gen) for c, n in shapes]
    tables = [[free.pop() for _ in range(-(-(c + n) // BS))] for c, n in shapes]
    for (c, _), table, k, v in zip(shapes, tables, full_k, full_v):     # pre-fill cached context
        for p in range(c):
            cache[0, table[p // BS], p % BS], cache[1, table[p // BS], p % BS] = k[p], v[p]
    batch = AttentionBatch([n for _, n in shapes], [c for c, _ in shapes], tables, BS, torch.device("cpu"))
    metadata = backend.build_metadata(batch)
    q = torch.randn(sum(n for _, n in shapes), HQ, D, generator=gen)
    new_k = torch.cat([k[c:] for (c, _), k in zip(shapes, full_k)])
    new_v = torch.cat([v[c:] for (c, _), v in zip(shapes, full_v)])
    out = backend.forward(q, new_k, new_v, cache, metadata, scale=0.3)
    start = 0
    for (c, n), k, v in zip(shapes, full_k, full_v):
        torch.testing.assert_close(out[start:start + n], _reference(q[start:start + n], k, v, 0.3, c),
                                   atol=1e-5, rtol=1e-5)
        start += n


def test_pure_decode_all_same_length_needs_no_mask():
    backend = TorchAttentionBackend()
    batch = AttentionBatch([1, 1], [4, 4], [[0, 1], [2, 3]], BS, torch.device("cpu"))
    metadata = backend.build_metadata(batch)
    assert metadata.decode is not None and metadata.decode.key_mask is None and not metadata.prefills
    assert metadata.slot_mapping.tolist() == [1 * BS + 0, 3 * BS + 0]


def test_attention_without_metadata_is_causal_over_the_batch():
    layer = Attention(HQ, HKV, D, scale=0.5, layer_idx=0)
    q, k, v = torch.randn(5, HQ, D), torch.randn(5, HKV, D), torch.randn(5, HKV, D)
    with set_forward_context(None):
        out = layer(q, k, v)
    torch.testing.assert_close(out.view(5, HQ, D), _reference(q, k, v, 0.5, 0), atol=1e-5, rtol=1e-5)


def test_bf16_masks_follow_query_dtype():
    backend = TorchAttentionBackend()
    cache = torch.zeros(2, 8, BS, HKV, D, dtype=torch.bfloat16)
    batch = AttentionBatch([1, 1, 3], [2, 6, 2], [[0, 1], [2, 3], [4, 5]], BS, torch.device("cpu"))
    metadata = backend.build_metadata(batch)
    q = torch.randn(5, HQ, D, dtype=torch.bfloat16)
    kv = torch.randn(5, HKV, D, dtype=torch.bfloat16)
    out = backend.forward(q, kv, kv, cache, metadata, scale=0.3)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_prefill_chunks_take_the_fused_cpu_kernel():
    """A prefill chunk's SDPA ([Hq, Lq, D], GQA, with and without cached context) runs the CPU's
    fused flash kernel, not the unfused math path that 3-D inputs fell to (2-8x slower a chunk;
    about half of W6's prefill), and matches the reference."""
    from torch.profiler import profile  # noqa: PLC0415

    from tokenforge.model.attention.torch_backend import attend, causal_mask  # noqa: PLC0415

    gen = torch.Generator().manual_seed(3)
    for context in (0, 5):
        q, k, v = torch.randn(7, HQ, D, generator=gen), torch.randn(context + 7, HKV, D, generator=gen), \
            torch.randn(context + 7, HKV, D, generator=gen)
        mask = causal_mask(context, context + 7, None, q.device) if context else None
        with profile() as prof:
            out = attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), 0.3, mask, mask is None)
        names = {e.key for e in prof.key_averages()}
        assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names, names
        assert "aten::_scaled_dot_product_attention_math" not in names
        torch.testing.assert_close(out.transpose(0, 1), _reference(q, k, v, 0.3, context), rtol=1e-4, atol=1e-5)
