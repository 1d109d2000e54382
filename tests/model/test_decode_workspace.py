"""The CPU decode workspaces give exactly the gather path's attention, step after step, through
batch changes (a sequence leaving, a new one joining) and capacity growth."""

from __future__ import annotations

import torch

from tokenforge.model.attention.backend import AttentionBatch
from tokenforge.model.attention.torch_backend import TorchAttentionBackend

BS, HKV, G, D, NUM_BLOCKS = 4, 2, 3, 8, 1200


def _step(backend, cache, tables, ctx, q, k, v):
    batch = AttentionBatch([1] * len(ctx), list(ctx), [list(t) for t in tables], BS, torch.device("cpu"))
    meta = backend.build_metadata(batch)
    return backend.forward(q, k, v, cache, meta, scale=0.3)


def test_workspace_matches_gather_path():
    torch.manual_seed(0)
    fast, ref = TorchAttentionBackend(), TorchAttentionBackend(use_workspaces=False)
    cache_fast = torch.randn(2, NUM_BLOCKS, BS, HKV, D)
    cache_ref = cache_fast.clone()
    free = list(range(NUM_BLOCKS))
    ctx = [int(c) for c in torch.randint(1, 60, (20,))]   # 20 sequences: several length groups
    tables = [[free.pop() for _ in range(-(-(c + 1) // BS))] for c in ctx]
    for step in range(70):
        if step == 30:                      # a sequence leaves: the batch changes shape
            ctx.pop(5), tables.pop(5)
        if step == 50:                      # a new one joins
            ctx.append(2), tables.append([free.pop()])
        for i, c in enumerate(ctx):         # grow block tables as the scheduler would
            if c // BS >= len(tables[i]):
                tables[i].append(free.pop())
        n = len(ctx)
        q, k, v = torch.randn(n, HKV * G, D), torch.randn(n, HKV, D), torch.randn(n, HKV, D)
        out_fast = _step(fast, cache_fast, tables, ctx, q, k, v)
        out_ref = _step(ref, cache_ref, tables, ctx, q, k, v)
        torch.testing.assert_close(out_fast, out_ref, atol=1e-5, rtol=1e-5)
        ctx = [c + 1 for c in ctx]
    assert fast.workspaces.continues, "steady decode steps should reuse the workspace"


def test_one_sequence_and_sorted_batches_skip_reordering():
    """One sequence (the plain `generate "Hi"`) and a batch already longest first take the
    no-reordering path, step after step through capacity growth, with the gather path's output."""
    torch.manual_seed(1)
    for ctx in ([3], [40, 17, 9]):
        fast, ref = TorchAttentionBackend(), TorchAttentionBackend(use_workspaces=False)
        cache_fast = torch.randn(2, NUM_BLOCKS, BS, HKV, D)
        cache_ref = cache_fast.clone()
        free = list(range(NUM_BLOCKS))
        tables = [[free.pop() for _ in range(-(-(c + 1) // BS))] for c in ctx]
        for _ in range(80):                 # past the first capacity (max_len + 64)
            for i, c in enumerate(ctx):
                if c // BS >= len(tables[i]):
                    tables[i].append(free.pop())
            n = len(ctx)
            q, k, v = torch.randn(n, HKV * G, D), torch.randn(n, HKV, D), torch.randn(n, HKV, D)
            out_fast = _step(fast, cache_fast, tables, ctx, q, k, v)
            assert fast.workspaces.identity
            torch.testing.assert_close(out_fast, _step(ref, cache_ref, tables, ctx, q, k, v), atol=1e-5, rtol=1e-5)
            ctx = [c + 1 for c in ctx]
        assert fast.workspaces.continues
