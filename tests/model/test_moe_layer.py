"""The MoE building blocks on their own: MXFP4 decoding against transformers' own, gpt-oss's
clamped SwiGLU against HF's, expert ranges under expert parallelism, experts of another rank
skipped by the reference and the alignment, attention sinks in the torch backend against the
plain softmax with one extra logit, and a backend without sinks refused when assigned (both real
backends have them: tests/kernels/test_attention_sinks.py checks the Triton kernels)."""

from __future__ import annotations

import types

import pytest
import torch

from tokenforge.kernels.moe import align, moe_reference, route
from tokenforge.kernels.mxfp4 import Mxfp4Stack, dequantize_mxfp4, quantize_mxfp4
from tokenforge.model.attention import AttentionBatch, TorchAttentionBackend
from tokenforge.model.attention.spec import AttentionSpec
from tokenforge.model.layers import Attention
from tokenforge.model.layers.moe import expert_range, swiglu_oai


def test_mxfp4_decodes_as_transformers_does():
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 8, 4), generator=gen, dtype=torch.uint8)
    theirs = _convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)      # [E, in, out]
    assert torch.equal(dequantize_mxfp4(blocks, scales), theirs.transpose(1, 2))
    assert torch.equal(Mxfp4Stack(blocks, scales)[2], theirs[2].t())


def test_mxfp4_quantize_round_trips_representable_values():
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (5, 64 // 2), generator=gen, dtype=torch.uint8).view(5, 2, 16)
    scales = torch.randint(120, 130, (5, 2), generator=gen, dtype=torch.uint8)
    values = dequantize_mxfp4(blocks, scales)
    again = dequantize_mxfp4(*quantize_mxfp4(values))
    assert torch.equal(again, values)


def test_clamped_swiglu_is_hfs():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=8, num_local_experts=2, swiglu_limit=1.5))
    gate_up = torch.randn(6, 16) * 3                                     # interleaved, as HF computes it
    want = experts._apply_gate(gate_up)
    assert torch.allclose(swiglu_oai(gate_up[:, 0::2], gate_up[:, 1::2], 1.702, 1.5), want)


def test_expert_ranges_cover_every_expert_once():
    spans = [expert_range(10, r, 4) for r in range(4)]
    assert spans == [(0, 3), (3, 3), (6, 2), (8, 2)]
    with pytest.raises(ValueError, match="with 5 ranks needs at least as many experts; the model has 4"):
        expert_range(4, 0, 5)


def test_other_ranks_experts_are_skipped():
    """Ids equal to E (routed to another rank) add nothing, in the reference and in the alignment."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 16, generator=gen)
    w13, w2 = torch.randn(4, 24, 16, generator=gen), torch.randn(4, 16, 12, generator=gen)
    weights, ids = route(torch.randn(7, 4, generator=gen), 2)
    away = ids == 3
    masked = torch.where(away, 4, ids)                  # expert 3 lives elsewhere
    want = moe_reference(x, w13, w2, torch.where(away, 0.0, weights), ids)
    assert torch.allclose(moe_reference(x, w13, w2, weights, masked), want, atol=1e-5)
    sorted_ids, expert_of_block, valid = align(masked, 4, 4)
    n = int(valid)
    inside = sorted_ids[:n][sorted_ids[:n] < masked.numel()].long()
    assert sorted(inside.tolist()) == sorted((~away).flatten().nonzero().flatten().tolist())


def _sink_reference(q, k, v, sinks, scale, window=None):
    """One sequence, plain math: q [T, Hq, D], k/v [T, Hkv, D] (all positions 0..T-1)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    pos = torch.arange(q.shape[0])
    hidden = pos[None, :] > pos[:, None]
    if window is not None:
        hidden |= pos[None, :] <= pos[:, None] - window
    scores = scores.masked_fill(hidden, float("-inf"))
    logits = torch.cat([scores, sinks.view(-1, 1, 1).expand(-1, q.shape[0], 1)], dim=-1)
    return torch.einsum("hqk,khd->qhd", torch.softmax(logits, -1)[..., :-1], v)


@pytest.mark.parametrize("window", [None, 3])
def test_torch_backend_sinks_match_the_plain_softmax(window):
    gen = torch.Generator().manual_seed(3)
    t, hq, hkv, d, bs = 11, 4, 2, 8, 4
    q, k, v = (torch.randn(t, h, d, generator=gen) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=gen) * 2
    want = _sink_reference(q, k, v, sinks, 0.3, window)
    backend = TorchAttentionBackend()
    cache = torch.zeros(backend.kv_cache_shape(8, bs, hkv, d))
    table = [5, 2, 7]
    # prefill of 7 (no context), a chunk of 3 over cached context, then one decode
    got = []
    for start, end in ((0, 7), (7, 10), (10, 11)):
        meta = backend.build_metadata(AttentionBatch([end - start], [start], [table], bs, torch.device("cpu")))
        got.append(backend.forward(q[start:end], k[start:end], v[start:end], cache, meta, 0.3, sliding_window=window,
                                   sinks=sinks))
    assert torch.allclose(torch.cat(got), want, atol=1e-5)


def test_a_backend_without_sinks_is_refused_when_assigned():
    attn = Attention(4, 2, 8, 0.3, layer_idx=5, spec=AttentionSpec(sinks=True))
    with pytest.raises(NotImplementedError, match="attention sinks \\(layer 5\\) are not implemented in the flash "
                                                  "attention backend yet; use --attention-backend torch"):
        attn.backend = types.SimpleNamespace(name="flash")       # a backend without `supports_sinks`
    assert tuple(attn.sinks.shape) == (4,) and attn.sinks.dtype == torch.float32
