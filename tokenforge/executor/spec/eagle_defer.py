"""The EAGLE head's catch-up, deferred over the steps that draft nothing (executor/spec/eagle.py).

Why: a step the adaptive rule gives no drafts still has to feed the head the target's features,
or the head's KV of those positions goes stale and its later drafts suffer. Done every step that
costs the host a plan, three gathers, a metadata fill and a graph replay: on the bundled 135M model
at batch 1, whose steps are host-bound, an EAGLE engine that drafted almost nothing ran at 0.70-0.76x
of none on an H100 (BENCHMARKS.md round 25).

What: at batch 1 (one running sequence) an idle step only copies the previous step's feature rows
into a ring [R, F] (one copy: they are contiguous); their tokens are the request's own, known on the host by the time
they are needed. Before anything reads the head's KV again (a step that drafts, a wider batch, a
full ring) one eager head pass runs over the kept rows as a chunk at their positions, writing the
same KV the per-step catch-ups would have. A request that ends or changes drops what it kept (its
blocks are gone, and nothing reads them). Positions whose tokens are not known yet are never run
(the flush happens on a step the host has read back).
"""

from __future__ import annotations

import torch

from tokenforge.executor.input_batch import device_index

ROWS = 256          # rows kept before a flush (an idle stretch longer than this flushes once per ROWS steps)


class DeferredCatchUp:
    def __init__(self, width: int, dtype: torch.dtype, device: torch.device, rows: int = ROWS) -> None:
        self.ring = torch.zeros(rows, width, dtype=dtype, device=device)
        self.device = device
        self.request_id: str | None = None
        self.first = 0                     # the position of ring row 0
        self.count = 0                     # rows kept
        self.flushes = 0                   # head passes run over kept rows (tests read it)

    def takes(self, request_id: str, first: int, rows: int) -> bool:
        """Whether `rows` catch-up rows of `request_id` from position `first` can be kept: they
        continue what is kept (or nothing is) and fit the ring."""
        if self.count == 0:
            return rows <= len(self.ring)
        return (request_id == self.request_id and first == self.first + self.count
                and self.count + rows <= len(self.ring))

    def add(self, request_id: str, first: int, feats: torch.Tensor) -> None:
        """Keep the feature rows `feats` [n, F] (positions first, first + 1, ...): one copy."""
        n = feats.shape[0]
        if self.count == 0:
            self.request_id, self.first = request_id, first
        self.ring[self.count:self.count + n].copy_(feats)
        self.count += n

    def flush(self, seqs, run_chunk) -> None:
        """Run the head over the kept rows (`run_chunk(block_table, first, ids, features)`: one eager
        pass, EagleDrafter.run_chunk), if their request still runs and the tokens after them are
        known; then keep nothing."""
        n, first = self.count, self.first
        self.count = 0
        if n == 0:
            return
        seq = next((s for s in seqs if s.request_id == self.request_id), None)
        if seq is None:
            return                         # ended (or not in this step): nothing reads its head KV now
        history = seq.prompt_token_ids + seq.output_token_ids
        if len(history) < first + n + 1:
            return                         # the tokens after them are not known yet: left stale, drafts stay exact
        run_chunk(seq.block_table, first, device_index(history[first + 1:first + n + 1], self.device), self.ring[:n])
        self.flushes += 1

    def drop(self) -> None:
        self.count = 0
