"""The static draft tree of `--speculative-tree`: the nodes an EAGLE head proposes each step.

Node 0 is the root (the sequence's last known token); node i > 0 is the rank-r child of
`parents[i]`: the head's r-th most likely token after its parent. The tree is chosen once from the
node budget K (num_speculative_tokens) by a fixed prior: a rank-r child is reached RANK_PRIOR[r]
times as often as its parent, and the K nodes most often reached are kept (a deep first-choice
chain with side branches where the head's second and third choices pay). Nodes are numbered
breadth first (depth, then parent, then rank), so the first m + 1 nodes are a tree too: a draft
cut by max_tokens (its depth) or by the token budget (its node count) is a prefix of it.

Read by the scheduler's planner (how many nodes fit) and by the runner (each node's position and
ancestors: its attention mask), so it lives here, beside the config both import; so does
`burst_steps`, the other draft shape both sides must agree on (n-gram bursts at batch 1).
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from dataclasses import dataclass

RANK_PRIOR = (0.7, 0.15, 0.08, 0.04)     # a rank-r child's chance of acceptance, relative to its parent


@dataclass(frozen=True, slots=True)
class DraftTree:
    parents: tuple[int, ...]     # per node; -1 for the root
    ranks: tuple[int, ...]       # per node: which of its parent's top-k tokens it is (root: 0)
    depths: tuple[int, ...]      # per node, nondecreasing (root: 0)

    @classmethod
    def build(cls, budget: int, prior: tuple[float, ...] = RANK_PRIOR) -> DraftTree:
        """The `budget` nodes (besides the root) with the highest prior chance of being reached."""
        chosen = [(-1, 0)]                       # (parent, rank) in the order chosen
        chance = [1.0]
        heap = [(-prior[0], 0, 0)]               # (-chance, parent, rank): the frontier
        while len(chosen) <= budget:
            neg, parent, rank = heapq.heappop(heap)
            chosen.append((parent, rank))
            chance.append(-neg)
            heapq.heappush(heap, (neg * prior[0], len(chosen) - 1, 0))              # its first child
            if rank + 1 < len(prior):                                                # its next sibling
                heapq.heappush(heap, (-chance[parent] * prior[rank + 1], parent, rank + 1))
        return cls._breadth_first(chosen)

    @classmethod
    def _breadth_first(cls, chosen: list[tuple[int, int]]) -> DraftTree:
        children: dict[int, list[tuple[int, int]]] = {}
        for i, (parent, rank) in enumerate(chosen[1:], start=1):
            children.setdefault(parent, []).append((rank, i))
        parents, ranks, depths, frontier, new = [-1], [0], [0], [0], {0: 0}
        while frontier:
            following = []
            for old in frontier:
                for rank, child in sorted(children.get(old, ())):
                    new[child] = len(parents)
                    parents.append(new[old])
                    ranks.append(rank)
                    depths.append(depths[new[old]] + 1)
                    following.append(child)
            frontier = following
        return cls(tuple(parents), tuple(ranks), tuple(depths))

    @property
    def num_nodes(self) -> int:
        """Drafted nodes (the root not counted)."""
        return len(self.parents) - 1

    def nodes_within(self, depth: int) -> int:
        """Drafted nodes at depth <= `depth` (the first that many follow the root)."""
        return max(0, bisect_right(self.depths, depth) - 1)

    def ancestry(self) -> list[list[bool]]:
        """[n][n]: row i marks node i and its ancestors (the keys a node's attention sees)."""
        rows = [[False] * len(self.parents) for _ in self.parents]
        for i, row in enumerate(rows):
            for a in self.ancestors(i):
                row[a] = True
        return rows

    def ancestors(self, node: int) -> list[int]:
        """The node and its ancestors up to the root, root first."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def tree_drafts_apply(config) -> bool:
    """--speculative-tree on an attention backend that masks trees (torch: the CPU's, or the GPU's
    with --attention-backend torch). The triton backend (the GPU default) has no tree kernel yet:
    there the EAGLE head drafts chains, as without the flag."""
    if not config.scheduler.speculative_tree:
        return False
    backend = config.device.attention_backend
    if backend == "auto":
        backend = "triton" if config.device.resolved_device() == "cuda" else "torch"
    return backend == "torch"


BURST_STEPS = 8     # iterations a burst chains: ~45 ms of the 8B shape's verify steps, ~5 ms of a 135M model's
MAX_BURST_STEPS = 32
BURST_WEIGHT_BYTES = 16e9   # the 8B shape in bf16: BURST_STEPS; a smaller model takes more, to ~the same time


def burst_length(weight_bytes: int | None) -> int:
    """Iterations a burst holds the device for a model of `weight_bytes` (None: BURST_STEPS). A
    burst that ends early (EOS, max_tokens) skips the rest on the device, so only a request that
    arrives meanwhile pays for the length: it waits up to ~50 ms. Fewer, longer bursts save the
    host's read-back, scheduling and launch between two of them (~1-2 ms each)."""
    if not weight_bytes:
        return BURST_STEPS
    return int(max(BURST_STEPS, min(MAX_BURST_STEPS, BURST_STEPS * BURST_WEIGHT_BYTES / weight_bytes)))


def burst_steps(config, forced: int | None = None, host_proposer: bool = False, weight_bytes: int | None = None) -> int:
    """Verify iterations an n-gram burst chains on the device for a lone greedy request
    (executor/spec/burst.py; 0: no bursts). Where they apply by default: the n-gram method on one
    GPU with CUDA graphs, no LoRA, no offloaded layers; `burst_length(weight_bytes)` of them (bursts
    that skip their iterations past a stop; None: BURST_STEPS). `forced` (TOKENFORGE_SPEC_BURST)
    overrides that: 0 off, N > 0 on any device, eager where there are no graphs (the CPU tests).
    None where a bench's host proposer drafts in the n-gram method's place (`host_proposer`)."""
    s = config.scheduler
    if s.speculative_method != "ngram" or host_proposer:
        return 0
    if forced is not None:
        return max(0, forced)
    backend = config.device.attention_backend
    on_graphs = (config.device.resolved_device() == "cuda" and not config.device.enforce_eager
                 and backend in ("auto", "triton"))
    single = config.parallel.world_size == 1 and not config.load.cpu_offload_gb
    return burst_length(weight_bytes) if on_graphs and single and not config.lora.enable_lora else 0
