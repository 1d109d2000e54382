"""CUDA graphs for the EAGLE head's draft (executor/spec/eagle.py): a step's whole draft, the
catch-up and the K - 1 decodes of the head alone, is one graph replay per batch bucket.

In: the drafter's plan of one step (the catch-up's rows: feature rows, the tokens after them,
positions, per sequence its rows, context and block table; the draft start position S' of each
sequence), for steps where every caught-up sequence drafts the same d <= K tokens and caught up on at
most K + 1 rows (every verify step at a steady batch; a prefill's catch-up runs eagerly).
Out: the drafts [N, d] written into the step's draft rows of the input ids.

One graph per (bucket, d): the adaptive rule may pick any d from 1 to K for a step, and d = 0 is the
catch-up alone, for steps that draft nothing (the rule said 0): the head's KV keeps up with the
target at the cost of one graph replay, no LM head, so the rule can turn drafting back on.
The catch-up runs as decode rows (cuda_graph.decode_rows: row r of a sequence is a decode whose
context is the r tokens before it), padded to (K + 1) x bucket rows with slot -1, so its shape is
fixed; each sequence's last row is picked by an index that is a graph input. The K - 1 decodes
(d - 1 of them) each read their own persistent metadata buffers (contexts S' + j), all refilled before the replay.
Buckets 1, 2, 4, 8 (up to max_num_seqs); graphs share one memory pool. Captured after the head's KV
cache is allocated; a capture that fails leaves the drafter eager (logged).
"""

from __future__ import annotations

import logging
import time

import torch

from tokenforge.executor.cuda_graph import decode_rows, time_replays
from tokenforge.model.attention.backend import AttentionBatch
from tokenforge.model.attention.triton_backend import DecodeMetadataBuffers
from tokenforge.model.forward_context import set_forward_context

logger = logging.getLogger(__name__)
BUCKETS = (1, 2, 4, 8)


class EagleGraphs:
    def __init__(self, head, k: int, max_num_seqs: int, max_model_len: int, block_size: int,
                 feature_width: int, dtype: torch.dtype, device: torch.device, backend, capture: bool = True) -> None:
        self.head, self.k, self.block_size, self.device, self.backend = head, k, block_size, device, backend
        self.buckets = [b for b in BUCKETS if b <= max(1, max_num_seqs)]
        b_max = self.buckets[-1]
        rows = (k + 1) * b_max
        max_blocks = -(-max_model_len // block_size)
        self.feats = torch.zeros(rows, feature_width, dtype=dtype, device=device)
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        # [last rows (b_max) | draft start positions (b_max)]: one upload a step
        self.index = torch.zeros(2 * b_max, dtype=torch.long, device=device)
        self.catch_up = DecodeMetadataBuffers(rows, max_blocks, device)
        self.decodes = [DecodeMetadataBuffers(b_max, max_blocks, device) for _ in range(k - 1)]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}     # (bucket, drafts d)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None
        self.replays = 0
        # False: the same static buffers and body, run eagerly without padding rows, the metadata
        # built by the backend, the catch-up as one chunk per sequence, not decode rows (CPU tests:
        # the torch backend has no persistent decode buffers)
        self.capture = capture

    # ---- capture ----

    def capture_all(self) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            for b in self.buckets:
                for d in range(self.k + 1):
                    self._capture(b, d)
        return time.perf_counter() - t0

    def _metadata(self, b: int) -> list:
        empty = AttentionBatch([], [], [], self.block_size, self.device)
        rows = (self.k + 1) * b
        return [self.catch_up.fill(empty, padded_batch_size=rows)] + [d.fill(empty, padded_batch_size=b)
                                                                      for d in self.decodes]

    def _capture(self, b: int, d: int) -> None:
        metadata = self._metadata(b)
        for _ in range(2):      # Triton autotuning and lazy init outside the capture
            self._body(b, (self.k + 1) * b, metadata, d)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._body(b, (self.k + 1) * b, metadata, d)
        torch.cuda.synchronize(self.device)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(b, d)], self.outputs[(b, d)] = graph, out

    def _body(self, b: int, rows: int, metadata: list, d: int) -> torch.Tensor:
        """The d drafts of b sequences from the static buffers' first `rows` catch-up rows -> tokens [b, d]
        (d = 0: the catch-up alone, writing the head's KV)."""
        head = self.head
        hidden = head.combine(self.feats[:rows])
        with set_forward_context(_made(metadata[0]), None):
            out, nxt = head(self.ids[:rows], self.positions[:rows], hidden)
        if d == 0:
            return out.new_empty((b, 0), dtype=torch.long)
        last = self.index[:b]
        tokens, hidden = head.draft_tokens(out[last]), nxt[last]
        drafts = [tokens]
        half = len(self.index) // 2
        start = self.index[half:half + b]
        for j in range(d - 1):
            with set_forward_context(_made(metadata[1 + j]), None):
                out, hidden = head(tokens, start + j, hidden)
            tokens = head.draft_tokens(out)
            drafts.append(tokens)
        return torch.stack(drafts, dim=1)

    def replay_seconds(self, b: int, d: int) -> float | None:
        """Device seconds of the (b, d) draft graph on padding rows (None if not captured): the
        head's share of a speculative step, for the adaptive rule's calibration."""
        if (b, d) not in self.graphs:
            return None
        self._metadata(self.buckets[-1])
        with torch.inference_mode():
            return time_replays(self.graphs[(b, d)])

    def release(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None

    # ---- one step ----

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def fits(self, qlens: list[int]) -> bool:
        return bool(qlens) and self.bucket(len(qlens)) is not None and max(qlens) <= self.k + 1

    def run(self, feats: torch.Tensor, ids: torch.Tensor, index: torch.Tensor, t: int, qlens: list[int],
            ctx: list[int], tables: list, last: list[int], starts: list[int], d: int) -> torch.Tensor:
        """The d drafts [N, d] of the N sequences caught up (in order; d = 0: the catch-up alone);
        `index` holds the catch-up's feature rows, token rows (into `ids`) and positions, t each (as
        the eager path builds it)."""
        n = len(qlens)
        b = self.bucket(n)
        self.feats[:t].copy_(feats[index[:t]])
        self.ids[:t].copy_(ids[index[t:2 * t]])
        self.positions[:t].copy_(index[2 * t:3 * t])
        half = len(self.index) // 2
        host = torch.zeros(len(self.index), dtype=torch.long)
        host[:n] = torch.tensor(last)
        host[half:half + n] = torch.tensor(starts)
        self.index.copy_(host.to(self.device, non_blocking=True))
        batch = AttentionBatch(qlens, ctx, tables, self.block_size, self.device)
        steps = [AttentionBatch([1] * n, [s + j for s in starts], tables, self.block_size, self.device)
                 for j in range(d - 1)]
        self.replays += 1
        if not self.capture:
            # built right before each forward: the CPU backend's decode workspace plans per call
            metadata = [lambda x=x: self.backend.build_metadata(x) for x in [batch, *steps]]
            return self._body(n, t, metadata, d)
        self.catch_up.fill(decode_rows(batch), padded_batch_size=(self.k + 1) * b)
        for buffers, x in zip(self.decodes, steps):
            buffers.fill(x, padded_batch_size=b)
        self.graphs[(b, d)].replay()
        return self.outputs[(b, d)][:n]


def _made(metadata):
    return metadata() if callable(metadata) else metadata
