"""Tree drafts from an EAGLE head (--speculative-tree; batch 1, the torch attention backend).

Chosen once by the runner (components.py `make_drafter`) where `tree_drafts_apply` holds, with `TreeDriver`
(tree_verify.py) as its role; on the triton backend the head drafts chains (eagle.py) instead.

A step whose sequence drafts m nodes of the static DraftTree (config/draft_tree.py):
1. the previous step's accepted path (`StepInFlight.accepted_rows`, set by the verify) is moved
   into the rows a chain's would hold: its hidden states, token ids and EAGLE-3 features, so the
   catch-up (eagle.py, unchanged) reads the accepted tokens as after a chain;
2. the catch-up's last row (the root's head output) gives the depth-1 nodes: its top-k tokens, the
   rank-r node taking the r-th; each further level takes its nodes from a head pass over the level
   before: a node's input is its token and its parent's predicted feature, its position its
   parent's target position (S + depth - 1), its head KV at slot S + i - 1, and its attention sees
   the context before S and its own ancestors only (a TreeMask, one chunk per level);
3. the target's verify layout: row i (node i) at position S + depth(i), seeing the context and its
   ancestors (a TreeMask over slots S .. S + m); the step never runs as decode rows.
The head's tree KV (slots S .. S + m - 1) is rewritten by the next catch-up where it matters,
as a chain's draft KV is. The head runs eagerly (no CUDA graphs for trees).
"""

from __future__ import annotations

import logging

import torch

from tokenforge.config.draft_tree import DraftTree
from tokenforge.executor.input_batch import device_index
from tokenforge.executor.spec.eagle import EagleDrafter
from tokenforge.executor.spec.tree_verify import TreeTensors
from tokenforge.model.attention.backend import AttentionBatch, TreeMask

logger = logging.getLogger(__name__)


class EagleTreeDrafter(EagleDrafter):
    def __init__(self, runner, tree: DraftTree) -> None:
        super().__init__(runner)
        self.tree = TreeTensors(tree, self.device)

    def enable_graphs(self, capture: bool) -> None:
        logger.info("EAGLE head: tree drafts run the head eagerly (no CUDA graphs)")

    def before_forward(self, step) -> None:
        self._realign_previous()
        super().before_forward(step)

    def _realign_previous(self) -> None:
        """Move the previous step's accepted path to the rows of a chain (root row first)."""
        prev = self._last[0] if self._last is not None else None
        if prev is None or prev.accepted_rows is None or prev.hidden is None:
            return
        src = prev.accepted_rows
        dst = src[0] + torch.arange(src.shape[0], device=src.device)
        prev.hidden[dst] = prev.hidden[src]
        prev.inputs.input_ids[dst] = prev.inputs.input_ids[src]
        if self.capture is not None:
            feats = self.capture.features(prev.inputs.query_start_loc[-1])
            if feats is not None:
                feats[dst] = feats[src]
        prev.accepted_rows = None

    def _draft(self, step, drafted: list[tuple[int, int, int]], caught: dict[int, int]) -> None:
        """The layout of the step's one drafted sequence, then its nodes' tokens in its input ids."""
        (i, first, m), = drafted
        inputs, seq = step.inputs, step.sched.sequences[i]
        start, root, n = seq.start_position, first - 1, m + 1
        inputs.positions[root:root + n] = start + self.tree.depths[:n]
        masks: list[TreeMask | None] = [None] * len(step.sched.sequences)
        masks[i] = TreeMask(start, self.tree.ancestry[:n, :n])
        inputs.attn_batch.tree_masks = masks
        inputs.rows_are_decodes = False
        if i not in caught:                # no catch-up (its previous step unknown): drafts the verify rejects
            inputs.input_ids[first:first + m] = inputs.input_ids[root]
            return
        out_rows, next_hidden = self._out
        self._expand(inputs, i, root, n, out_rows[caught[i]][None], next_hidden[caught[i]][None])

    def _expand(self, inputs, i: int, root: int, n: int, rows: torch.Tensor, hidden: torch.Tensor) -> None:
        """Level by level: the nodes' tokens from their parents' top-k, then (unless it is the
        last level) the head over the level. `rows`, `hidden`: the previous level's head outputs."""
        tree, start = self.tree.tree, inputs.attn_batch.context_lens[i]
        table = inputs.attn_batch.block_tables[i]
        level_start, first = 0, 1                         # the previous level's first node, this level's
        while first < n:
            depth = tree.depths[first]
            last = first
            while last + 1 < n and tree.depths[last + 1] == depth:
                last += 1
            parents = device_index([p - level_start for p in tree.parents[first:last + 1]], self.device)
            ranks = device_index(tree.ranks[first:last + 1], self.device)
            top = self.head.draft_topk(rows, max(tree.ranks[first:last + 1]) + 1)    # [parents, k]
            tokens = top[parents, ranks]                                             # [level]
            inputs.input_ids[root + first:root + last + 1] = tokens
            if last + 1 == n:
                return
            width = last - first + 1
            visible = self.tree.ancestry[first:last + 1, 1:last + 1]       # node b's head KV: slot S + b - 1
            batch = AttentionBatch([width], [start + first - 1], [table], self.block_size, self.device,
                                   tree_masks=[TreeMask(start, visible)])
            positions = torch.full((width,), start + depth - 1, device=self.device)
            rows, hidden = self._forward(batch, tokens, positions, hidden[parents])
            level_start, first = first, last + 1
