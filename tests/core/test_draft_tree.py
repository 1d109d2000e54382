"""The static draft tree of --speculative-tree (config/draft_tree.py) and the planner's tree
shape (core/speculation.py `TreeShape`): plain data, no torch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenforge.config.draft_tree import DraftTree, tree_drafts_apply
from tokenforge.core.request import Request
from tokenforge.core.speculation import DraftPlanner, TreeShape, device_drafts

from tests.core.core_fakes import make_request


@pytest.mark.parametrize("budget", [1, 4, 8, 16])
def test_every_prefix_is_a_tree_with_contiguous_ranks(budget):
    tree = DraftTree.build(budget)
    assert tree.num_nodes == budget and tree.parents[0] == -1
    for i in range(1, len(tree.parents)):
        p = tree.parents[i]
        assert p < i and tree.depths[i] == tree.depths[p] + 1           # a parent comes before its children
        assert tree.depths[i] >= tree.depths[i - 1]                      # breadth first
        siblings = [j for j in range(1, i) if tree.parents[j] == p]      # the ones numbered before it
        assert tree.ranks[i] == len(siblings)                            # ranks 0, 1, ... in order


def test_a_budget_of_eight_branches_and_goes_deep():
    tree = DraftTree.build(8)
    assert tree.parents == (-1, 0, 0, 1, 1, 3, 5, 6, 7)
    assert tree.ranks == (0, 0, 1, 0, 1, 0, 0, 0, 0)
    assert [tree.nodes_within(d) for d in range(8)] == [0, 2, 4, 5, 6, 7, 8, 8]
    assert tree.ancestors(8) == [0, 1, 3, 5, 6, 7, 8] and tree.ancestors(4) == [0, 1, 4]
    rows = tree.ancestry()
    assert [j for j, seen in enumerate(rows[4]) if seen] == [0, 1, 4]
    assert DraftTree.build(4).parents == (-1, 0, 1, 2, 3)                # a small budget: a chain


def test_the_tree_shape_cuts_by_depth_and_slots_and_serves_requests_without_row_histories():
    planner = DraftPlanner(device_drafts, 8, shape=TreeShape(DraftTree.build(8)))
    planner.adaptive = False
    planner.begin_step(1)

    def drafts(budget=64, **params):
        req = Request.from_engine_core_request(make_request("r", [1, 2, 3], **params))
        req.append_output_token(5)
        req.num_computed_tokens = req.num_tokens - 1
        return len(planner.drafts(req, budget=budget, max_len=256))
    assert drafts(max_tokens=32, temperature=0.0) == 8
    assert drafts(max_tokens=4, temperature=0.0) == 4          # 2 more tokens after the next: depth 2
    assert drafts(max_tokens=32, temperature=0.0, budget=4) == 3          # 3 node slots in the token budget
    assert drafts(max_tokens=32, temperature=0.8, seed=4) == 8
    for params in ({"logprobs": 1}, {"frequency_penalty": 0.5}, {"min_tokens": 5, "eos": (7,)}):
        assert drafts(max_tokens=32, temperature=0.8, **params) == 0, params


def _config(tree: bool, device: str, backend: str):
    return SimpleNamespace(scheduler=SimpleNamespace(speculative_tree=tree),
                           device=SimpleNamespace(attention_backend=backend, resolved_device=lambda: device))


def test_trees_apply_where_the_attention_backend_masks_them():
    assert tree_drafts_apply(_config(True, "cpu", "auto"))
    assert tree_drafts_apply(_config(True, "cuda", "torch"))
    assert not tree_drafts_apply(_config(True, "cuda", "auto"))          # triton: chains
    assert not tree_drafts_apply(_config(True, "cuda", "triton"))
    assert not tree_drafts_apply(_config(False, "cpu", "auto"))
