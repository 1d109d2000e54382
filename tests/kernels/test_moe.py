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
    assert sorted_ids.numel() % block == 0 and sorted_ids.numel() >= pairs + min(experts, pairs) * (block - 1)
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
@pytest.mark.parametrize("gemv", [None, True])        # the table's path; the per-pair GEMVs forced
def test_fused_moe_matches_reference(tokens, hidden, inter, experts, k, gemv):
    torch.manual_seed(tokens)
    dev = "cuda"
    x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=dev) / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device=dev) / inter ** 0.5).bfloat16()
    weights, ids = route(torch.randn(tokens, experts, device=dev), k)
    out = fused_moe(x, w13, w2, weights, ids, gemv=gemv)
    ref = moe_reference(x, w13, w2, weights, ids)
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert err < 2e-2, err


def _random_experts(e, h, i, gen, mxfp4):
    from tokenforge.kernels.mxfp4 import Mxfp4Stack

    if mxfp4:
        return (Mxfp4Stack(torch.randint(0, 256, (e, 2 * i, h // 32, 16), generator=gen, dtype=torch.uint8),
                           torch.randint(118, 124, (e, 2 * i, h // 32), generator=gen, dtype=torch.uint8)),
                Mxfp4Stack(torch.randint(0, 256, (e, h, i // 32, 16), generator=gen, dtype=torch.uint8),
                           torch.randint(118, 124, (e, h, i // 32), generator=gen, dtype=torch.uint8)))
    return torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5, torch.randn(e, h, i, generator=gen) / i ** 0.5


def _on(w, device, dtype):
    from tokenforge.kernels.mxfp4 import Mxfp4Stack

    if isinstance(w, Mxfp4Stack):
        return Mxfp4Stack(w.blocks.to(device), w.scales.to(device))
    return w.to(device, dtype)


@pytest.mark.parametrize("variant", ["bias", "swiglu_oai", "mxfp4", "mxfp4_oai_bias", "other_rank",
                                     "mxfp4_other_rank"])
@pytest.mark.parametrize("tokens", [3, 70])
# the grouped GEMMs; the per-pair GEMVs; MXFP4's row GEMVs (kernels/moe_rows.py: the grouped
# GEMMs' place for MXFP4 at these sizes, 2-24 rows an expert, so "grouped" turns them off)
@pytest.mark.parametrize("path", ["grouped", "gemv", "rows"])
def test_fused_moe_epilogues_match_reference(device, variant, tokens, path, monkeypatch):
    """Biases, gpt-oss's clamped SwiGLU, MXFP4 experts decoded in the kernel, and ids of another
    rank's experts (expert parallelism), against the torch reference."""
    import functools

    from tokenforge.kernels import moe_rows
    from tokenforge.model.layers.moe import swiglu_oai

    if path == "rows" and not variant.startswith("mxfp4"):
        pytest.skip("the row GEMVs are MXFP4's")
    monkeypatch.setattr(moe_rows, "ENABLED", path == "rows")
    gemv = path == "gemv"

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32      # the interpreter has no bf16 dots
    gen = torch.Generator().manual_seed(tokens)
    h, i, e, k = 128, 96, 6, 2
    mxfp4 = variant.startswith("mxfp4")
    w13, w2 = _random_experts(e, h, i, gen, mxfp4)
    x = torch.randn(tokens, h, generator=gen)
    weights, ids = route(torch.randn(tokens, e, generator=gen), k)
    biased = variant in ("bias", "mxfp4_oai_bias")
    b13, b2 = (torch.randn(e, 2 * i, generator=gen) / 4, torch.randn(e, h, generator=gen) / 4) if biased else (None, None)
    oai = variant in ("swiglu_oai", "mxfp4_oai_bias")
    if variant.endswith("other_rank"):
        ids = torch.where(ids == 1, e, ids)
    act = functools.partial(swiglu_oai, alpha=1.702, limit=0.4) if oai else None
    ref = moe_reference(x, w13, w2, weights, ids, b13, b2, **({"activation": act} if act else {}))
    x, w13, w2 = x.to(device, dtype), _on(w13, device, dtype), _on(w2, device, dtype)
    b13, b2 = (None, None) if b13 is None else (b13.to(device, dtype), b2.to(device, dtype))
    out = fused_moe(x, w13, w2, weights.to(device), ids.to(device), b13, b2,
                    "swiglu_oai" if oai else "silu", 1.702, 0.4, gemv=gemv)
    err = (out.float().cpu() - ref).norm() / ref.norm()
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), err


DECODE_CASES = [("float", 128, 8, "softmax_topk", True), ("float", 8, 2, "softmax_topk", True),
                ("fp8", 128, 8, "softmax_topk", True), ("mxfp4", 32, 4, "topk_softmax", False),
                ("mxfp4", 128, 4, "topk_softmax", False)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt,experts,k,order,renorm,tokens", [
    (*case, tokens) for case in DECODE_CASES for tokens in (1, 4)])
def test_decode_gemvs_match_reference_and_repeat_exactly(fmt, experts, k, order, renorm, tokens):
    """The decode GEMV path from the router logits (batch 1: routed in the kernels; 4: after
    route_align), the per-pair gate-up and down GEMVs and `topk_sum`: the reference's result, bit
    for bit the same on a second call and on a CUDA-graph replay (no atomics, no race between the
    launches)."""
    from tokenforge.kernels.moe_fp8 import Fp8Stack, quantize_fp8_stack
    from tokenforge.kernels.moe_routing import fused_moe_from_logits

    gen = torch.Generator().manual_seed(experts * k + tokens)
    h, i = 512, 384
    w13, w2 = _random_experts(experts, h, i, gen, fmt == "mxfp4")
    w13, w2 = _on(w13, "cuda", torch.bfloat16), _on(w2, "cuda", torch.bfloat16)
    if fmt == "fp8":
        w13, w2 = Fp8Stack(*quantize_fp8_stack(w13)), Fp8Stack(*quantize_fp8_stack(w2))
    x = torch.randn(tokens, h, generator=gen).to("cuda", torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=gen).cuda()
    weights, ids = route(logits, k, order, renorm)
    ref = moe_reference(x, w13, w2, weights, ids).float()

    def step():
        return fused_moe_from_logits(x, logits, w13, w2, k, order, renorm, gemv=True, all_local=True)

    out = step()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2
    assert torch.equal(step(), out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = step()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, out)


@pytest.mark.parametrize("hidden, inter", [(192, 160), (256, 96)])   # K steps of 64 and 32; 128 and 32
def test_mxfp4_rows_take_any_whole_group_width(device, hidden, inter, monkeypatch):
    """The MXFP4 row path (kernels/moe_rows.py) picks its K step from the widths (any multiple of 32),
    with experts whose rows span several 16-row blocks, against the reference."""
    from tokenforge.kernels import moe_rows

    monkeypatch.setattr(moe_rows, "ENABLED", True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(hidden + inter)
    tokens, e, k = 40, 4, 2
    w13, w2 = _random_experts(e, hidden, inter, gen, mxfp4=True)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = route(torch.randn(tokens, e, generator=gen), k)
    assert moe_rows.rows_path("mxfp4", tokens * k, e) and torch.bincount(ids.flatten()).max() > moe_rows.ROWS_BLOCK_M
    ref = moe_reference(x, w13, w2, weights, ids)
    out = fused_moe(x.to(device, dtype), _on(w13, device, dtype), _on(w2, device, dtype), weights.to(device),
                    ids.to(device), gemv=False)
    err = (out.float().cpu() - ref).norm() / ref.norm()
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), err


@pytest.mark.parametrize("tokens,experts,k,order,first,num_local", [
    (128, 128, 8, "softmax_topk", 0, None),        # Qwen3-30B-A3B's W1 prefill
    (2048, 8, 2, "softmax_topk", 0, None),         # Mixtral, a long prefill chunk
    (513, 128, 4, "topk_softmax", 32, 32),         # gpt-oss-120b under expert parallelism, a partial block
])
def test_route_align_wide_equals_route_and_align(device, tokens, experts, k, order, first, num_local):
    """The three-launch routing of batches past one program (kernels/moe_route_wide.py) gives
    `route` + `align`'s weights, local ids and layout exactly, at both blocks the GEMMs take."""
    from tokenforge.kernels.moe_routing import fits, route_align

    assert not fits(tokens, experts, k)
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens)).to(device)
    count = experts if num_local is None else num_local
    want_weights, want_ids = route(logits, k, order, renormalize=order == "softmax_topk")
    local = want_ids - first
    local = torch.where((local >= 0) & (local < count), local, count)
    for block in (16, 64):
        weights, ids, sorted_ids, expert_of_block, valid = route_align(logits, k, order, order == "softmax_topk",
                                                                       block, first, num_local)
        want_sorted, want_experts, want_valid = align(local, count, block)
        assert torch.equal(ids, local) and torch.allclose(weights, want_weights, rtol=1e-6, atol=1e-7)
        n = int(want_valid)
        assert int(valid) == n and torch.equal(sorted_ids[:n], want_sorted[:n])
        assert (sorted_ids[n:] == tokens * k).all() and torch.equal(expert_of_block, want_experts)
