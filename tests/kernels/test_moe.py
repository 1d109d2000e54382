"""MoE routing, alignment and the fused grouped GEMMs against plain torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenforge.kernels.moe import align, fused_moe, moe_reference, route


def _dense_moe(x, w13, w2, weights, ids):
    """Every expert on every token, masked by the routing: a different computation of the same."""
    h = torch.einsum("th,eih->tei", x.double(), w13.double())
    gate, up = h.chunk(2, dim=-1)
    y = torch.einsum("tei,ehi->teh", F.silu(gate) * up, w2.double())
    mix = torch.zeros(x.shape[0], w13.shape[0], dtype=torch.float64).scatter_add_(1, ids, weights.double())
    return (y * mix[..., None]).sum(1)


def test_routing_orders():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 8, generator=gen)
    w, ids = route(logits, 2, "softmax_topk", renormalize=False)
    probs = torch.softmax(logits, -1)
    assert torch.equal(ids, probs.topk(2, -1).indices)
    torch.testing.assert_close(w, probs.gather(1, ids))
    w, _ = route(logits, 2, "softmax_topk", renormalize=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(5))
    w, ids = route(logits, 3, "topk_softmax")
    torch.testing.assert_close(w, torch.softmax(logits.gather(1, ids), -1))
    with pytest.raises(ValueError, match="unknown routing order"):
        route(logits, 2, "sigmoid")
    with pytest.raises(ValueError, match="top_k=9"):
        route(logits, 9)


@pytest.mark.parametrize("tokens,experts,k,block", [(1, 8, 2, 16), (7, 4, 2, 4), (33, 16, 4, 8)])
def test_align_sorts_pairs_by_expert_in_padded_blocks(tokens, experts, k, block):
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    sorted_ids, expert_of_block, valid = align(ids, experts, block)
    pairs = tokens * k
    assert sorted_ids.numel() % block == 0 and sorted_ids.numel() >= pairs + experts * (block - 1)
    n = int(valid)
    real = sorted_ids[:n][sorted_ids[:n] < pairs]
    assert sorted(real.tolist()) == list(range(pairs))            # every pair exactly once
    assert (sorted_ids[n:] == pairs).all()                       # only padding past the valid length
    flat = ids.flatten()
    for b in range(n // block):
        members = sorted_ids[b * block:(b + 1) * block]
        members = members[members < pairs].long()
        assert (flat[members] == expert_of_block[b]).all()
    assert (expert_of_block[n // block:] == -1).all()


def test_reference_matches_the_dense_computation():
    gen = torch.Generator().manual_seed(1)
    t, h, i, e, k = 9, 16, 24, 6, 2
    x = torch.randn(t, h, generator=gen)
    w13, w2 = torch.randn(e, 2 * i, h, generator=gen) / 4, torch.randn(e, h, i, generator=gen) / 4
    weights, ids = route(torch.randn(t, e, generator=gen), k)
    torch.testing.assert_close(moe_reference(x, w13, w2, weights, ids).double(), _dense_moe(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens,hidden,inter,experts,k", [
    (1, 256, 512, 8, 2), (4, 512, 384, 8, 2), (16, 256, 192, 128, 8), (300, 512, 256, 32, 4)])
def test_fused_moe_matches_reference(tokens, hidden, inter, experts, k):
    torch.manual_seed(tokens)
    dev = "cuda"
    x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=dev) / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device=dev) / inter ** 0.5).bfloat16()
    weights, ids = route(torch.randn(tokens, experts, device=dev), k)
    out = fused_moe(x, w13, w2, weights, ids)
    ref = moe_reference(x, w13, w2, weights, ids)
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert err < 2e-2, err
