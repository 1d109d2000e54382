"""CUDA-graph capture in two stages: the decode buckets the first requests need before Ready, the
rest afterwards, one bucket at a time, while the engine is idle.

`StagedCapture` is the policy, free of torch so the CPU tests drive it with a fake `capture_one`:
it knows which buckets exist, which are captured, which graph a decode batch replays, and how many
decode steps ran eagerly because their bucket had no graph yet (correct, only slower).
`CudaGraphRunner` (cuda_graph.py) gives it the real capture. Without deferral (the offline `LLM`,
tensor parallelism, whose ranks must capture in step) every bucket is captured at start-up.

Stage one is the buckets up to FIRST_STAGE_MAX_BATCH: a server's first requests arrive a few at a
time. The engine core captures the others from its idle loop (core_process.CoreLoop, through
EngineCore.idle_work): never while a request is queued or running; a request that arrives
during one bucket's capture waits for that one capture (tens of ms; ~0.1-0.2 s for the largest
on an 8B model), not for the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)

FIRST_STAGE_MAX_BATCH = 8


class StagedCapture:
    def __init__(self, sizes: Iterable[int], capture_one: Callable[[int], None], defer: bool,
                 first_stage_max: int = FIRST_STAGE_MAX_BATCH, first: Iterable[int] = ()) -> None:
        """`first`: buckets stage one captures whatever their size (a lone request's verify rows)."""
        self.sizes = sorted(set(sizes))
        self.capture_one = capture_one
        must = set(first)
        stage_one = [s for s in self.sizes if s <= first_stage_max or s in must] or self.sizes[:1]
        # At start-up largest first (the smaller graphs reuse the first one's memory pool); the
        # deferred ones smallest first, since the batches a growing load needs next are the small ones.
        self.initial = sorted(stage_one if defer else self.sizes, reverse=True)
        self.pending = [s for s in self.sizes if s not in self.initial]
        self.captured: set[int] = set()
        self.initial_seconds = 0.0
        self.background_seconds = 0.0
        self.eager_decode_steps = 0       # decode-only steps whose bucket had no graph yet

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def capture_initial(self) -> float:
        start = time.perf_counter()
        for size in self.initial:
            self._capture(size)
        self.initial_seconds = time.perf_counter() - start
        later = f"; {len(self.pending)} more (batch {self.pending[0]}..{self.pending[-1]}) once the engine " \
                "is idle" if self.pending else ""
        logger.info("captured %d CUDA graphs (batch %d..%d) in %.2f s%s", len(self.initial), min(self.initial),
                    max(self.initial), self.initial_seconds, later)
        return self.initial_seconds

    def capture_next(self) -> bool:
        """Capture one deferred bucket; whether any remain. The last one logs the stage's total."""
        if not self.pending:
            return False
        start = time.perf_counter()
        self._capture(self.pending.pop(0))
        self.background_seconds += time.perf_counter() - start
        if not self.pending:
            logger.info("CUDA graphs: the deferred buckets captured while idle in %.2f s; all %d ready "
                        "(batch %d..%d); %d decode steps ran without a graph meanwhile", self.background_seconds,
                        len(self.sizes), self.sizes[0], self.sizes[-1], self.eager_decode_steps)
        return bool(self.pending)

    def _capture(self, size: int) -> None:
        self.capture_one(size)
        self.captured.add(size)

    def bucket(self, num_seqs: int, count_miss: bool = True) -> int | None:
        """The captured graph a decode batch of `num_seqs` replays (its bucket), or None: it runs
        eagerly (counted, unless `count_miss` is False: a step with prompt rows), because that
        bucket is not captured yet or the batch exceeds them all."""
        for size in self.sizes:
            if size >= num_seqs:
                if size in self.captured:
                    return size
                break
        if num_seqs <= self.max_batch and count_miss:
            self.eager_decode_steps += 1
        return None
