"""The runner's speculative components, each chosen once at start-up from the config: the role
after the target's forward (verification) and the drafter before it (draft slots filled on the
device). With --speculative-tree on a backend that masks trees (`tree_drafts_apply`): the tree
drafter and verifier; the scheduler's planner makes the same choice (engine_core `draft_shape`)."""

from __future__ import annotations

from tokenforge.config.draft_tree import DraftTree, tree_drafts_apply
from tokenforge.executor.spec.draft import DraftModel, NoDrafter
from tokenforge.executor.spec.roles import SpeculativeDriver, SpeculativeFollower


def make_speculative_role(runner):
    if not runner.rank.is_driver:
        return SpeculativeFollower(runner)
    if tree_drafts_apply(runner.config):
        from tokenforge.executor.spec.tree_verify import TreeDriver  # noqa: PLC0415

        return TreeDriver(runner, DraftTree.build(runner.config.scheduler.num_draft_tokens))
    return SpeculativeDriver(runner)


def make_drafter(runner):
    method = runner.config.scheduler.speculative_method
    if method == "eagle" and tree_drafts_apply(runner.config):
        from tokenforge.executor.spec.eagle_tree import EagleTreeDrafter  # noqa: PLC0415

        return EagleTreeDrafter(runner, DraftTree.build(runner.config.scheduler.num_draft_tokens))
    if method == "eagle":
        from tokenforge.executor.spec.eagle import EagleDrafter  # noqa: PLC0415

        return EagleDrafter(runner)
    return DraftModel(runner) if method == "draft" else NoDrafter()
