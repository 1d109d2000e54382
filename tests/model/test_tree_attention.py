"""Tree attention on the torch backend (model/attention/backend.py `TreeMask`): each draft tree
node attends to the cached context and its own ancestors only, as if its root-to-node path were
the sequence; its k/v still land at the chunk's contiguous slots."""

from __future__ import annotations

import torch

from tokenforge.config.draft_tree import DraftTree
from tokenforge.model.attention import AttentionBatch, get_attention_backend
from tokenforge.model.attention.backend import TreeMask
from tokenforge.model.attention.torch_backend import attend

HQ, HKV, D, BS = 4, 2, 8, 4
SCALE = D ** -0.5


def _ancestry(tree: DraftTree) -> torch.Tensor:
    """[n, n] bool: row i marks i and its ancestors."""
    n = len(tree.parents)
    a = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        a[i, tree.ancestors(i)] = True
    return a


def _setup(ctx: int, gen: torch.Generator):
    backend = get_attention_backend("torch", "cpu")
    cache = torch.zeros(backend.kv_cache_shape(16, BS, HKV, D))
    table = [5, 2, 9, 11, 3, 7]
    kc, vc, qc = (torch.randn(ctx, h, D, generator=gen) for h in (HKV, HKV, HQ))
    batch = AttentionBatch([ctx], [0], [table], BS, torch.device("cpu"))
    backend.forward(qc, kc, vc, cache, backend.build_metadata(batch), SCALE)
    return backend, cache, table, kc, vc


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query [Hq, D] over keys/values [S, Hkv, D], no mask."""
    return attend(q[:, None, :], keys.transpose(0, 1), values.transpose(0, 1), SCALE)[:, 0, :]


def test_each_node_sees_the_context_and_its_ancestors_only():
    gen = torch.Generator().manual_seed(0)
    ctx, tree = 7, DraftTree.build(8)
    backend, cache, table, kc, vc = _setup(ctx, gen)
    n = len(tree.parents)
    q, k, v = (torch.randn(n, h, D, generator=gen) for h in (HQ, HKV, HKV))
    batch = AttentionBatch([n], [ctx], [table], BS, torch.device("cpu"), tree_masks=[TreeMask(ctx, _ancestry(tree))])
    out = backend.forward(q, k, v, cache, backend.build_metadata(batch), SCALE)
    assert len(set(tree.depths)) > 2 and max(tree.parents.count(p) for p in range(n)) > 1   # a real tree
    for i in range(n):
        path = tree.ancestors(i)
        want = _reference(q[i], torch.cat([kc, k[path]]), torch.cat([vc, v[path]]))
        torch.testing.assert_close(out[i], want, atol=1e-5, rtol=1e-5)
    flat = cache.view(2, -1, HKV, D)
    slots = [table[p // BS] * BS + p % BS for p in range(ctx, ctx + n)]
    assert torch.equal(flat[0, slots], k) and torch.equal(flat[1, slots], v)    # stored in order


def test_a_later_level_sees_the_nodes_before_its_chunk():
    """The EAGLE head's layout: a level's nodes are a chunk after the levels before it (base <
    context_len); a node sees its ancestors among those earlier slots and itself."""
    gen = torch.Generator().manual_seed(1)
    ctx = 6
    backend, cache, table, kc, vc = _setup(ctx, gen)
    # slots ctx + 0, 1: two siblings (first level); then three nodes: children of slot 0, 1, 0
    first = [torch.randn(2, h, D, generator=gen) for h in (HQ, HKV, HKV)]
    level1 = AttentionBatch([2], [ctx], [table], BS, torch.device("cpu"),
                            tree_masks=[TreeMask(ctx, torch.eye(2, dtype=torch.bool))])
    backend.forward(*first, cache, backend.build_metadata(level1), SCALE)
    q, k, v = (torch.randn(3, h, D, generator=gen) for h in (HQ, HKV, HKV))
    parents = [0, 1, 0]
    visible = torch.zeros(3, 5, dtype=torch.bool)
    for i, p in enumerate(parents):
        visible[i, p] = visible[i, 2 + i] = True
    level2 = AttentionBatch([3], [ctx + 2], [table], BS, torch.device("cpu"), tree_masks=[TreeMask(ctx, visible)])
    out = backend.forward(q, k, v, cache, backend.build_metadata(level2), SCALE)
    for i, p in enumerate(parents):
        keys = torch.cat([kc, first[1][p:p + 1], k[i:i + 1]])
        values = torch.cat([vc, first[2][p:p + 1], v[i:i + 1]])
        torch.testing.assert_close(out[i], _reference(q[i], keys, values), atol=1e-5, rtol=1e-5)
