"""Verification of a draft tree (--speculative-tree, batch 1): one target forward over every node,
the longest accepted root-to-leaf path emitted, its KV moved to where a chain's would be.

A tree-drafted sequence holds n = 1 + m rows: its last known token t (node 0, the root) and the
first m nodes of the static DraftTree (config/draft_tree.py), breadth first, at slots S .. S + m
(S: t's position). Row i sits at position S + depth(i) and sees the context and its own ancestors
only (a TreeMask the drafter sets, eagle_tree.py), so its logits are the target's after the path
root..i. x_i is the token the target emits at row i: its argmax (greedy), or a draw from its
sampling distribution there (`node_samples`: one noise row per depth, shared by a depth's nodes,
so the nodes of any one path draw independently; a seeded request's rows come from its own
generator, rewound after the step to the draws of the tokens emitted). Node i is accepted when
its token equals x_parent(i) and its parent is accepted. Siblings hold distinct tokens (the head's
top-k), so the accepted nodes form one root-to-leaf path (with repeated tokens the deepest, then
the first, leaf wins); the sequence emits x along it: the path's drafts, then x after its leaf.
Greedy, that is the greedy continuation token for token; sampled, it is the multi-candidate
rejection rule for one-hot drafts (rejection.py: follow the child whose token is the target's
sample, else emit the sample), so each emitted token is distributed as the target's, and a seeded
request emits what it emits without speculation. The path's target KV moves from slots S + path[j] to S + j (gathered
before it is scattered: path[j] >= j), so the scheduler's rollback frees the slots past the
accepted tokens as after a chain. Everything stays on the device (no host sync): the results
travel back as a chain verify's do ([1, D + 2]: the tokens, then the accepted count).

Trees serve requests without logprobs, penalties or banned ids (core/speculation.py `TreeShape`):
every node's history would differ; those requests decode without drafts.
"""

from __future__ import annotations

import torch

from tokenforge.config.draft_tree import DraftTree
from tokenforge.executor.roles import Driver, copy_back
from tokenforge.executor.sampler import SamplerOutput, SamplingBatch, processed_logits, sampling_probs
from tokenforge.executor.spec.roles import SpeculativeDriver, VerifyInFlight, _split_plain


class TreeTensors:
    """The static tree on the device: ancestry [n, n] bool, depths [n], parents [n] (root: 0)."""

    def __init__(self, tree: DraftTree, device: torch.device) -> None:
        self.tree = tree
        self.ancestry = torch.tensor(tree.ancestry(), dtype=torch.bool, device=device)
        self.depths = torch.tensor(tree.depths, dtype=torch.long, device=device)
        self.parents = torch.tensor([max(p, 0) for p in tree.parents], dtype=torch.long, device=device)


def accept_path(target: torch.Tensor, tokens: torch.Tensor, tree: TreeTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """target [n]: the token the target emits at each node (its argmax); tokens [n]: the nodes'
    own tokens (the root's unused). Returns (path [D + 1]: the accepted nodes root first, padded
    with j past the accepted count (a no-op move); accepted: 0-d, the path's drafts)."""
    n = target.shape[0]
    depth_max = tree.tree.depths[n - 1]
    ok = tokens == target[tree.parents[:n]]
    ok[0] = True
    ancestry = tree.ancestry[:n, :n]
    alive = ~(ancestry & ~ok[None, :]).any(dim=1)                 # the node and all its ancestors accepted
    depths = tree.depths[:n]
    leaf = torch.where(alive, depths, -1).argmax()                # the deepest accepted node (the first)
    index = torch.arange(n, device=target.device)
    order = torch.where(ancestry[leaf], index, index + n).sort().values[:depth_max + 1]   # the path, then the rest
    j = torch.arange(depth_max + 1, device=target.device)
    return torch.where(order < n, order, j), depths[leaf]


def node_samples(probs: torch.Tensor, depths: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """probs [n, V]: each node's sampling distribution; noise [D + 1, V] uniforms in [0, 1), one
    row per depth. The exponential race of the sampler (sample_from_probs), with node i's noise
    its depth's row: [n] tokens."""
    return (probs / noise.log().neg()[depths]).argmax(dim=-1)


def move_kv(layers: list, slots: torch.Tensor, path: torch.Tensor) -> None:
    """Each layer's KV of the path's nodes to the slots of positions S .. S + D. `slots` [n]: the
    nodes' cache slots in order (torch layout [2, blocks, block_size, Hkv, D])."""
    src, dst = slots[path], slots[:path.shape[0]]
    for layer in layers:
        cache = layer.kv_cache
        flat = cache.view(2, -1, *cache.shape[3:])                 # [2, num_slots, Hkv, D]
        flat[:, dst] = flat[:, src]                                # gathered first: no overlap hazard


class TreeDriver(SpeculativeDriver):
    """The driver of a tree-drafting engine: a step without drafts goes the plain way; a step
    with a tree (its only sequence) is verified by `accept_path`."""

    def __init__(self, runner, tree: DraftTree) -> None:
        super().__init__(runner)
        self.tree = TreeTensors(tree, runner.device)
        self.block_size = runner.block_size

    def after_forward(self, step, defer_sampling: bool) -> None:
        seqs = step.sched.sequences
        drafted = [s for s in seqs if s.sample and s.num_draft_tokens]
        if not drafted:
            return Driver.after_forward(self, step, defer_sampling)
        if len(seqs) != 1:
            raise RuntimeError("tree drafts are verified one sequence per step (max_num_seqs 1)")
        s = drafted[0]
        _split_plain(self, step)
        self._finish_launch(step, step.sched)            # no plain rows; prompt logits, the broadcast
        n = 1 + s.num_draft_tokens
        rows = slice(step.inputs.query_start_loc[0], step.inputs.query_start_loc[0] + n)
        target, rewinds = self._targets(s, self.model.compute_logits(step.hidden[rows]))    # [n]
        path, accepted = accept_path(target, step.inputs.input_ids[rows], self.tree)
        bs, table = self.block_size, s.block_table
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(s.start_position, s.start_position + n)],
                             device=self.device)
        move_kv(self.model.attention_layers(), slots, path)
        step.accepted_rows = rows.start + path           # the drafter's catch-up reads these rows next step
        result = torch.cat([target[path], accepted[None]])[None]                      # [1, D + 2]
        step.verify = VerifyInFlight([s], copy_back(SamplerOutput(result, None), self.device), path.shape[0] - 1,
                                     rewinds, self.vocab_size)

    def _targets(self, s, logits: torch.Tensor) -> tuple[torch.Tensor, list]:
        """logits [n, V] -> (the token the target emits at each node [n], the generator to rewind)."""
        if s.params.is_greedy:
            return logits.argmax(dim=-1), []
        n, vocab = logits.shape
        batch = SamplingBatch.build([s.params] * n, [s.prompt_token_ids] * n, [s.output_token_ids] * n, [None] * n,
                                    vocab, self.device)
        probs = sampling_probs(processed_logits(logits, batch)[0], batch)
        depths, gen = self.tree.depths[:n], self._generator(s)
        draws = self.tree.tree.depths[n - 1] + 1
        if gen is None:
            return node_samples(probs, depths, torch.rand(draws, vocab, device=self.device)), []
        state = gen.get_state()          # draws as the sampler's, one [V] row per token, in order
        noise = torch.stack([torch.rand(vocab, device=self.device, generator=gen) for _ in range(draws)])
        return node_samples(probs, depths, noise), [(0, gen, state)]
