"""TierManager: moves KV blocks between the device cache and the CPU, disk and Redis tiers.

In: each step's `BlockSave`s and `TierLoad`s (from core's KVTierPolicy), submitted before the
step's forward is queued. Out: `TierLoadResult`s, polled by the engine, and `KVTierStats`.

The CPU tier is driven from the engine thread, with no worker in between. A save takes its slots
in the CPU tier at once and queues, on the save stream, a gather of the blocks (the forward waits
only for that device-to-device copy) and one device-to-host copy per run of consecutive slots into
the pinned store. A load looks its hashes up in the CPU tier at submission, so it finds every block
saved before it (even one whose copy is still landing: the load stream waits for the save stream),
and queues the host-to-device copies on the load stream; it is done when their event has passed,
which `poll` checks without blocking. Nothing is dropped and nothing waits on a thread.

Blocks past the CPU tier's run go to the worker thread, which looks them up on disk, then in Redis
(pipelined), stops at the first block no tier holds, copies the hits into the request's device
blocks on the load stream and reports when they are there. The worker also writes the disk tier
(blocks the full CPU tier displaces, or evicted blocks when there is no CPU tier) and hands Redis
puts to their own thread behind a bounded queue: when it is full, puts are dropped and counted.
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
from tokenforge.executor.tiers.blocks import BlockMover, CopyHandle
from tokenforge.executor.tiers.codec import BlockCodec, BlockFormatError
from tokenforge.executor.tiers.disk import DiskTier
from tokenforge.executor.tiers.host import HostTier
from tokenforge.executor.tiers.remote import RemoteTier
from tokenforge.executor.tiers.stats import TierCounters

MAX_PENDING_SAVE_BLOCKS = 8192     # blocks queued for the worker (disk, Redis) before saves are dropped
MAX_PENDING_PUTS = 4096            # blocks queued for Redis before puts are dropped
SAVE_CHUNK_BLOCKS = 128            # blocks gathered per copy-out (bounds the device staging memory)
LOAD_CHUNK_BLOCKS = 256            # blocks per host-to-device staging copy of a load


def longest_run(found: list[bool]) -> int:
    """Leading hits (as core's policy counts them): a block after a miss cannot be used."""
    return next((i for i, hit in enumerate(found) if not hit), len(found))


@dataclass(slots=True)
class _SaveJob:
    saves: list[BlockSave]
    host: torch.Tensor             # [n, L, 2, bs, H, D], filled once `ready` has passed
    ready: torch.cuda.Event | None


@dataclass(slots=True)
class _DiskJob:
    blocks: list[tuple[bytes, torch.Tensor]]    # blocks the full CPU tier displaced


@dataclass(slots=True)
class _LoadJob:
    load: TierLoad                 # the whole load; the worker fetches the blocks at `positions`
    after: torch.cuda.Event | None    # the main stream's work queued before the load was submitted
    positions: list[int]           # blocks the CPU tier does not hold, in order
    cpu_found: list[bool]          # blocks whose copies from the CPU tier are in `handles`
    handles: list[CopyHandle]
    start: float


@dataclass(slots=True)
class _HostLoad:
    request_id: str
    found: list[bool]
    handles: list[CopyHandle]
    start: float


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
        self._host_loads: list[_HostLoad] = []        # CPU-tier loads whose copies are in flight
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
        if self.host is not None:
            local = [s for s in saves if not s.remote_only]
            if local:
                self._save_to_host(local)
            # Evicted blocks go to Redis too, through the worker (the CPU tier cascades to disk).
            saves = [s if s.remote_only else BlockSave(s.block_id, s.block_hash, remote_only=True)
                     for s in saves]
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
            self._submit_load(load)

    def _save_to_host(self, saves: list[BlockSave]) -> None:
        """Evicted blocks into the CPU tier: slots now, the copies on the save stream."""
        ids: list[int] = []
        slots: list[int] = []
        keys: set[bytes] = set()
        displaced: list[tuple[bytes, int]] = []
        num_put = 0

        def flush() -> None:
            if displaced and self.disk is not None:
                # The displaced blocks cascade to disk: copy them out before their slots are rewritten.
                self.mover.wait_saves()
                blocks = [(h, self.host.store[slot].clone()) for h, slot in displaced]
                self._jobs.put((1, next(self._seq), _DiskJob(blocks)))
            for i in range(0, len(ids), SAVE_CHUNK_BLOCKS):
                self.mover.save_to_store(ids[i:i + SAVE_CHUNK_BLOCKS], self.host.store,
                                         slots[i:i + SAVE_CHUNK_BLOCKS], reused_slots=bool(displaced))
            ids.clear(), slots.clear(), keys.clear(), displaced.clear()

        for save in saves:
            got = self.host.reserve(save.block_hash)
            if got is None:
                continue                         # already held: not copied again
            slot, old = got
            if old is not None:
                if old in keys:                  # displaces a block of this very batch: land it first
                    flush()
                displaced.append((old, slot))
            ids.append(save.block_id)
            slots.append(slot)
            keys.add(save.block_hash)
            num_put += 1
        flush()
        if num_put:
            self.counters.add("puts", "cpu", num_put)

    def _submit_load(self, load: TierLoad) -> None:
        """The CPU tier's hits are copied now; the blocks it lacks go to the worker (disk, Redis)."""
        start = time.perf_counter()
        after = self.mover.mark_main_stream()
        hashes, total = load.block_hashes, len(load.block_hashes)
        slots = self.host.lookup(hashes) if self.host is not None else [None] * total
        if self.disk is None and self.remote is None:      # nothing past the CPU tier's first miss helps
            slots = slots[:longest_run([s is not None for s in slots])]
        cpu_pos = [i for i, s in enumerate(slots) if s is not None]
        handles = []
        for i in range(0, len(cpu_pos), LOAD_CHUNK_BLOCKS):
            chunk = cpu_pos[i:i + LOAD_CHUNK_BLOCKS]
            handles.append(self.mover.load_from_store(self.host.store, [slots[p] for p in chunk],
                                                      [load.block_ids[p] for p in chunk], after))
        cpu_found = [i < len(slots) and slots[i] is not None for i in range(total)]
        if self.host is not None:
            if cpu_pos:
                self.counters.add("hits", "cpu", len(cpu_pos))
                self.counters.add("bytes_restored", "cpu", len(cpu_pos) * self.mover.block_bytes)
            misses = sum(1 for s in slots if s is None) + (total > len(slots))
            if misses:
                self.counters.add("misses", "cpu", misses)
        positions = [i for i in range(total) if not cpu_found[i]]
        if positions and (self.disk is not None or self.remote is not None):
            self._jobs.put((0, next(self._seq), _LoadJob(load, after, positions, cpu_found, handles, start)))
        else:
            self._host_loads.append(_HostLoad(load.request_id, cpu_found, handles, start))

    def _wants(self, save: BlockSave) -> bool:
        if save.remote_only:
            return self.remote is not None
        # Without a CPU tier, evicted blocks go to disk (once per hash).
        return self.disk is None or save.block_hash not in self.disk

    def poll(self) -> list[TierLoadResult]:
        done: list[TierLoadResult] = []
        if self._host_loads:
            still = []
            for hl in self._host_loads:
                if all(h.query() for h in hl.handles):
                    self._observe(hl.start, hl.handles, longest_run(hl.found))
                    done.append(TierLoadResult(hl.request_id, hl.found))
                else:
                    still.append(hl)
            self._host_loads = still
        with self._done_cv:
            done, self._done = done + self._done, []
        return done

    def _observe(self, start: float, handles, num_blocks: int, extra_copy_s: float = 0.0) -> None:
        if num_blocks:
            self.counters.observe_restore(time.perf_counter() - start,
                                          sum(h.copy_seconds() for h in handles) + extra_copy_s,
                                          num_blocks * self.mover.block_size)

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if any(all(h.query() for h in hl.handles) for hl in self._host_loads):
                return
            with self._done_cv:
                if self._done:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                # CPU-tier copies are polled through their events; the worker notifies.
                self._done_cv.wait(min(left, 0.0005) if self._host_loads else left)

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
                elif isinstance(job, _DiskJob):
                    for block_hash, block in job.blocks:
                        if self.disk.put(block_hash, self.mover.to_bytes(block)):
                            self.counters.add("puts", "disk")
                else:
                    self._restore(job)
            except Exception as e:  # noqa: BLE001 - a tier bug must not take the engine down
                self.counters.fault("internal", f"{type(e).__name__}: {e}")
                if isinstance(job, _LoadJob):
                    for h in job.handles:
                        h.synchronize()
                    self._finish(job.load.request_id, job.cpu_found)

    def _store(self, job: _SaveJob) -> None:
        if job.ready is not None:
            job.ready.synchronize()
        for save, block in zip(job.saves, job.host):
            if not save.remote_only and self.disk is not None and self.disk.put(save.block_hash, self.mover.to_bytes(block)):
                self.counters.add("puts", "disk")
            if self.remote is not None:
                self._queue_put(save.block_hash, block)
        with self._pending_lock:
            self._pending_save_blocks -= len(job.saves)

    def _queue_put(self, block_hash: bytes, block: torch.Tensor) -> None:
        try:
            self._puts.put_nowait((block_hash, self.mover.to_bytes(block)))
        except queue.Full:
            self.counters.add("dropped_puts", "backpressure")

    def _restore(self, job: _LoadJob) -> None:
        load, found = job.load, list(job.cpu_found)
        sources: list[torch.Tensor] = []
        ids: list[int] = []
        hashes = [load.block_hashes[p] for p in job.positions]
        remote: dict[int, bytes | None] = {}
        for i, p in enumerate(job.positions):
            block = self._find(i, hashes[i], hashes, remote)
            if block is None:
                break        # the blocks after it cannot be used: their prefix would be missing
            sources.append(block)
            ids.append(load.block_ids[p])
            found[p] = True
        copy_s = self.mover.scatter_from_host(sources, ids, job.after) if sources else 0.0
        for h in job.handles:
            h.synchronize()
        self._observe(job.start, job.handles, longest_run(found), copy_s)
        self._finish(load.request_id, found)

    def _find(self, i: int, block_hash: bytes, hashes: list[bytes], remote: dict[int, bytes | None]):
        """Block i from the first tier that has it (a tensor on the host), or None."""
        if self.disk is not None:
            found = self.disk.get(block_hash)
            if found is not None:
                return self._hit("disk", self.mover.from_bytes(found))
            self.counters.add("misses", "disk")
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

    def _finish(self, request_id: str, found: list[bool]) -> None:
        with self._done_cv:
            self._done.append(TierLoadResult(request_id, found))
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
