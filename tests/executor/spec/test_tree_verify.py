"""Verification of a draft tree (executor/spec/tree_verify.py): the accepted nodes are the longest
root-to-leaf path whose tokens match the target's argmax at their parents; the emitted tokens are
the argmax (or the sample) along it, so sampled output is distributed as the target's; the path's
KV moves to the slots a chain's would hold."""

from __future__ import annotations

import torch

from tokenforge.config.draft_tree import DraftTree
from tokenforge.executor.spec.tree_verify import TreeTensors, accept_path, move_kv, node_samples

from tests.executor.spec.test_rejection import CHI2_DF4_P1E4, _chi2

TREE = DraftTree.build(8)     # parents (-1, 0, 0, 1, 1, 3, 5, 6, 7): the chain 1-3-5-6-7-8, leaves 2 and 4


def _verify(tokens: list[int], target: list[int], n: int = 9):
    tree = TreeTensors(TREE, torch.device("cpu"))
    path, accepted = accept_path(torch.tensor(target[:n]), torch.tensor(tokens[:n]), tree)
    a = int(accepted)
    return path.tolist()[:a + 1], [target[i] for i in path.tolist()[:a + 1]], path.tolist()


def test_the_deepest_matching_path_wins():
    # node:      0   1   2   3   4   5   6   7   8
    tokens = [0, 10, 11, 20, 21, 30, 40, 50, 60]
    target = [10, 21, 99, 98, 31, 97, 96, 95, 94]          # root -> 10 (node 1), node 1 -> 21 (node 4)
    path, emitted, padded = _verify(tokens, target)
    assert path == [0, 1, 4] and emitted == [10, 21, 31]
    assert padded[3:] == [3, 4, 5, 6]                       # past the path: no-op moves
    target = [11, 0, 77, 0, 0, 0, 0, 0, 0]                  # the second choice at the root
    assert _verify(tokens, target)[:2] == ([0, 2], [11, 77])
    target = [10, 20, 0, 30, 0, 40, 50, 60, 70]             # the whole first-choice chain
    assert _verify(tokens, target)[:2] == ([0, 1, 3, 5, 6, 7, 8], [10, 20, 30, 40, 50, 60, 70])
    assert _verify(tokens, [5] * 9)[:2] == ([0], [5])       # nothing accepted: the root's argmax


def test_a_prefix_of_the_tree_and_a_mismatched_parent():
    tokens = [0, 10, 11, 20, 21, 30, 40, 50, 60]
    # node 3's token matches node 2's argmax, but node 3 hangs under node 1: not accepted
    target = [11, 0, 20, 0, 0, 0, 0, 0, 0]
    assert _verify(tokens, target)[:2] == ([0, 2], [11, 20])
    # the first 5 nodes only (depth 3 cut): the chain stops at node 5
    target = [10, 20, 0, 30, 0, 40, 0, 0, 0]
    path, emitted, padded = _verify(tokens, target, n=6)
    assert path == [0, 1, 3, 5] and emitted == [10, 20, 30, 40] and len(padded) == 4


def test_the_path_kv_moves_to_the_chain_slots():
    layer = type("Layer", (), {})()
    layer.kv_cache = torch.arange(2 * 4 * 4 * 1 * 2, dtype=torch.float32).view(2, 4, 4, 1, 2)   # 4 blocks of 4
    before = layer.kv_cache.clone().view(2, -1, 1, 2)
    slots = torch.tensor([5, 6, 7, 12, 13, 14, 15, 0, 1])     # nodes 0..8 over a block boundary
    move_kv([layer], slots, torch.tensor([0, 1, 4, 3, 4, 5, 6]))   # path 0, 1, 4; then no-op moves
    after = layer.kv_cache.view(2, -1, 1, 2)
    assert torch.equal(after[:, 7], before[:, 13])           # node 4's KV at the chain's slot 2
    assert torch.equal(after[:, 5], before[:, 5]) and torch.equal(after[:, 6], before[:, 6])
    untouched = [s for s in range(16) if s != 7]
    assert torch.equal(after[:, untouched], before[:, untouched])


def test_sampled_trees_emit_the_target_distribution():
    """Root with two candidate children (tokens 3 and 1, the head's first two choices), each with
    its own distribution after it: the first emitted token follows the root's distribution, the
    second one the distribution after whichever child was taken (or nothing was accepted)."""
    gen = torch.Generator().manual_seed(11)
    v, trials = 5, 12000
    tree = TreeTensors(DraftTree((-1, 0, 0), (0, 0, 1), (0, 1, 1)), torch.device("cpu"))   # two children
    probs = torch.softmax(torch.randn(3, v, generator=gen) * 1.5, dim=-1)
    probs[0] = torch.tensor([0.1, 0.3, 0.15, 0.35, 0.1])             # both children often taken
    nodes = torch.tensor([0, 3, 1])
    first, second = [], {3: [], 1: []}
    for _ in range(trials):
        noise = torch.rand(2, v, generator=gen)
        x = node_samples(probs, tree.depths, noise)
        path, accepted = accept_path(x, nodes, tree)
        emitted = x[path[:int(accepted) + 1]].tolist()
        first.append(emitted[0])
        if accepted:
            second[emitted[0]].append(emitted[1])
    assert _chi2(torch.tensor(first), probs[0]) < CHI2_DF4_P1E4
    assert len(second[3]) > 1000 and len(second[1]) > 1000
    assert _chi2(torch.tensor(second[3]), probs[1]) < CHI2_DF4_P1E4
    assert _chi2(torch.tensor(second[1]), probs[2]) < CHI2_DF4_P1E4
