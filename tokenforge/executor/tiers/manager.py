"""TierManager: moves KV blocks between the device cache and the CPU, disk and Redis tiers.

In: each step's `BlockSave`s and `TierLoad`s (from core's KVTierPolicy), submitted before the
step's forward is queued. Out: `TierLoadResult`s, polled by the engine, and `KVTierStats`.

Saves: the blocks are gathered on a side stream that first waits for the work already queued, and
the forward waits only for that gather (a device-to-device copy); the copy to pinned host memory
follows on the side stream, and the worker thread stores the blocks once it has landed. Loads:
the worker thread looks each hash up in the CPU tier, then on disk, then in Redis (pipelined),
stops at the first block no tier holds, copies the hits into the request's own device blocks on
the side stream and reports when they are there. Redis puts run on their own thread behind a
bounded queue: when it is full, puts are dropped and counted. One worker keeps the stores free of
races: a slot is only rewritten after the copies that read it have finished.
"""

from __future__ import annotations

import atexit
import itertools
import queue
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from tokenforge.core.outputs import BlockSave, TierLoad, TierLoadResult
from tokenforge.executor.tiers.blocks import BlockMover
from tokenforge.executor.tiers.codec import BlockCodec, BlockFormatError
from tokenforge.executor.tiers.disk import DiskTier
from tokenforge.executor.tiers.host import HostTier
from tokenforge.executor.tiers.remote import RemoteTier
from tokenforge.executor.tiers.stats import TierCounters

MAX_PENDING_SAVE_BLOCKS = 8192     # blocks queued for the worker before saves are dropped
MAX_PENDING_PUTS = 4096            # blocks queued for Redis before puts are dropped
SAVE_CHUNK_BLOCKS = 128            # blocks gathered per copy-out


@dataclass(slots=True)
class _SaveJob:
    saves: list[BlockSave]
    host: torch.Tensor             # [n, L, 2, bs, H, D], filled once `ready` has passed
    ready: torch.cuda.Event | None


@dataclass(slots=True)
class _LoadJob:
    load: TierLoad
    after: torch.cuda.Event | None    # the main stream's work queued before the load was submitted


class TierManager:
    def __init__(self, mover: BlockMover, codec: BlockCodec, counters: TierCounters, *,
                 host: HostTier | None, disk: DiskTier | None, remote: RemoteTier | None,
                 write_through: bool) -> None:
        self.mover, self.codec, self.counters = mover, codec, counters
        self.host, self.disk, self.remote = host, disk, remote
        self.write_through = write_through
        # Loads go first: a request waits on them, while a save only has to land before its block
        # is looked up again. Ties keep submission order.
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._pending_save_blocks = 0
        self._pending_lock = threading.Lock()
        self._puts: queue.Queue = queue.Queue(maxsize=MAX_PENDING_PUTS)
        self._done: list[TierLoadResult] = []
        self._done_cv = threading.Condition()
        self._stopping = False
        self._threads = [threading.Thread(target=self._work, name="kv-tier-worker", daemon=True)]
        if remote is not None:
            self._threads.append(threading.Thread(target=self._put_loop, name="kv-tier-puts", daemon=True))
        for t in self._threads:
            t.start()
        # Stop the threads before the interpreter tears down (a Redis client left in a daemon
        # thread at exit can abort the process); `shutdown` is idempotent.
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().shutdown())

    # ---- engine thread --------------------------------------------------------------------------

    def submit(self, saves: list[BlockSave], loads: list[TierLoad]) -> None:
        """Queue this step's transfers; call before the step's forward is queued."""
        saves = [s for s in saves if self._wants(s)]
        if saves:
            with self._pending_lock:
                room = self._pending_save_blocks + len(saves) <= MAX_PENDING_SAVE_BLOCKS
                self._pending_save_blocks += len(saves) if room else 0
            if not room:
                self.counters.add("dropped_puts", "backpressure", len(saves))
            else:       # in chunks, to bound the staging memory on the device and the host
                for i in range(0, len(saves), SAVE_CHUNK_BLOCKS):
                    chunk = saves[i:i + SAVE_CHUNK_BLOCKS]
                    host, ready = self.mover.gather_to_host([s.block_id for s in chunk])
                    self._jobs.put((1, next(self._seq), _SaveJob(chunk, host, ready)))
        for load in loads:
            self._jobs.put((0, next(self._seq), _LoadJob(load, self.mover.mark_main_stream())))

    def _wants(self, save: BlockSave) -> bool:
        if save.remote_only:
            return self.remote is not None
        # An evicted block the CPU tier (or, without one, the disk) already holds is not copied again.
        if self.host is not None:
            return save.block_hash not in self.host
        return self.disk is None or save.block_hash not in self.disk

    def poll(self) -> list[TierLoadResult]:
        with self._done_cv:
            done, self._done = self._done, []
        return done

    def wait(self, timeout: float) -> None:
        with self._done_cv:
            if not self._done:
                self._done_cv.wait(timeout)

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._jobs.put((-1, -1, None))
        if self.remote is not None:
            try:
                self._puts.put_nowait(None)
            except queue.Full:
                pass
        for t in self._threads:
            t.join(timeout=5)
        if self.remote is not None:
            self.remote.close()

    # ---- worker thread --------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            _, _, job = self._jobs.get()
            if job is None or self._stopping:
                return
            try:
                if isinstance(job, _SaveJob):
                    self._store(job)
                else:
                    self._restore(job)
            except Exception as e:  # noqa: BLE001 - a tier bug must not take the engine down
                self.counters.fault("internal", f"{type(e).__name__}: {e}")
                if isinstance(job, _LoadJob):
                    self._finish(job.load, [False] * len(job.load.block_hashes))

    def _store(self, job: _SaveJob) -> None:
        if job.ready is not None:
            job.ready.synchronize()
        for save, block in zip(job.saves, job.host):
            if not save.remote_only:
                self._store_local(save.block_hash, block)
            if self.remote is not None:
                self._queue_put(save.block_hash, block)
        with self._pending_lock:
            self._pending_save_blocks -= len(job.saves)

    def _store_local(self, block_hash: bytes, block: torch.Tensor) -> None:
        if self.host is not None:
            self.counters.add("puts", "cpu")
            displaced = self.host.put(block_hash, block)
            if displaced is None or self.disk is None:
                return
            block_hash, block = displaced
        if self.disk is not None and self.disk.put(block_hash, self.mover.to_bytes(block)):
            self.counters.add("puts", "disk")

    def _queue_put(self, block_hash: bytes, block: torch.Tensor) -> None:
        try:
            self._puts.put_nowait((block_hash, self.mover.to_bytes(block)))
        except queue.Full:
            self.counters.add("dropped_puts", "backpressure")

    def _restore(self, job: _LoadJob) -> None:
        start = time.perf_counter()
        hashes = job.load.block_hashes
        sources: list[torch.Tensor] = []
        remote: dict[int, bytes | None] = {}
        for i, block_hash in enumerate(hashes):
            block = self._find(i, block_hash, hashes, remote)
            if block is None:
                break
            sources.append(block)
        if sources:
            copy_s = self.mover.scatter_from_host(sources, job.load.block_ids[:len(sources)], job.after)
            self.counters.observe_restore(time.perf_counter() - start, copy_s, len(sources) * self.mover.block_size)
        self._finish(job.load, [i < len(sources) for i in range(len(hashes))])

    def _find(self, i: int, block_hash: bytes, hashes: list[bytes], remote: dict[int, bytes | None]):
        """Block i from the first tier that has it (a tensor on the host), or None."""
        for tier in (self.host, self.disk):
            if tier is None:
                continue
            found = tier.get(block_hash)
            if found is not None:
                block = found if tier is self.host else self.mover.from_bytes(found)
                return self._hit(tier.name, block)
            self.counters.add("misses", tier.name)
        if self.remote is None:
            return None
        if i not in remote:     # fetch the next window of hashes in one pipelined round trip
            window = hashes[i:i + self.remote.batch]
            values = self.remote.get_many([self.codec.key(h) for h in window])
            remote.update({i + j: v for j, v in enumerate(values)})
        value = remote.pop(i)
        if value is not None:
            try:
                return self._hit("remote", self.mover.from_bytes(self.codec.decode(block_hash, value)))
            except BlockFormatError as e:
                self.counters.fault(e.cause, f"Redis value for block {block_hash.hex()[:16]}: {e}")
        self.counters.add("misses", "remote")
        return None

    def _hit(self, tier: str, block: torch.Tensor) -> torch.Tensor:
        self.counters.add("hits", tier)
        self.counters.add("bytes_restored", tier, self.mover.block_bytes)
        return block

    def _finish(self, load: TierLoad, found: list[bool]) -> None:
        with self._done_cv:
            self._done.append(TierLoadResult(load.request_id, found))
            self._done_cv.notify_all()

    # ---- Redis put thread -----------------------------------------------------------------------

    def _put_loop(self) -> None:
        while True:
            item = self._puts.get()
            if item is None or self._stopping:
                return
            batch = [item]
            while len(batch) < self.remote.batch:
                try:
                    item = self._puts.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    return
                batch.append(item)
            if not self.remote.is_up:
                self.counters.add("dropped_puts", "remote_down", len(batch))
                continue
            values = [(self.codec.key(h), self.codec.encode(h, payload)) for h, payload in batch]
            written = self.remote.put_many(values)
            self.counters.add("puts", "remote", written)
            if written < len(batch):
                self.counters.add("dropped_puts", "remote_down", len(batch) - written)
