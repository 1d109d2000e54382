"""KV tier policy (no torch): which device blocks to copy out, and which to restore on admission.

In: cached blocks the pool evicts (`on_evict`), the registered blocks of completed requests
(`on_finish`, write-through), waiting requests whose prefix the device cache does not hold
(`start_load`), and the executor's `TierLoadResult`s. Out: per step, the `BlockSave`s and
`TierLoad`s the scheduler hands the executor in its `SchedulerOutput`, and for each finished load
how many leading blocks count as computed: the longest run of consecutive tier hits.

A request whose blocks are loading holds its device blocks and waits outside the queue while
others run; the executor copies into blocks that request alone holds. Once the load is done the
request goes back to the head of the queue with the restored tokens counted as computed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tokenforge.core.hashing import BlockHash
from tokenforge.core.kv_cache_manager import KVCacheManager
from tokenforge.core.outputs import BlockSave, TierLoad, TierLoadResult
from tokenforge.core.request import Request


def longest_run(found: Sequence[bool]) -> int:
    """Leading hits: a block after a miss cannot be used, its prefix would be missing."""
    for i, hit in enumerate(found):
        if not hit:
            return i
    return len(found)


class KVTierPolicy:
    def __init__(self, kv: KVCacheManager, write_through: bool, recent_capacity: int = 1 << 16) -> None:
        self.kv = kv
        self.block_size = kv.block_size
        self.write_through = write_through
        self.enabled = True                         # off: the device prefix cache alone (benchmarks)
        self.loading: dict[str, Request] = {}       # request id -> request whose blocks are loading
        self._inflight: dict[BlockHash, str] = {}   # first hash of each load in flight -> request id
        self._saves: list[BlockSave] = []
        self._loads: list[TierLoad] = []
        # Hashes written through recently: the blocks of a shared prefix are put once, not once
        # per request that used them.
        self._recent: OrderedDict[BlockHash, None] = OrderedDict()
        self._recent_capacity = recent_capacity
        self.num_restored_tokens = 0                # tokens counted as computed after a load
        self.num_loads = 0

    # ---- saves ---------------------------------------------------------------------------------

    def on_evict(self, block_id: int, block_hash: BlockHash) -> None:
        if self.enabled:
            self._saves.append(BlockSave(block_id, block_hash))

    def on_finish(self, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        """Write a completed request's full blocks through to the remote tier, once per hash."""
        if not (self.enabled and self.write_through):
            return
        for block_id, block_hash in blocks:
            if block_hash in self._recent:
                self._recent.move_to_end(block_hash)
                continue
            self._recent[block_hash] = None
            if len(self._recent) > self._recent_capacity:
                self._recent.popitem(last=False)
            self._saves.append(BlockSave(block_id, block_hash, remote_only=True))

    def has_work(self) -> bool:
        return bool(self.loading or self._saves or self._loads)

    def take_step_ops(self) -> tuple[list[BlockSave], list[TierLoad]]:
        saves, loads, self._saves, self._loads = self._saves, self._loads, [], []
        return saves, loads

    # ---- loads ---------------------------------------------------------------------------------

    def should_look_up(self, req: Request) -> bool:
        return self.enabled and not req.tier_looked_up and self.kv.is_lookup_allowed(req)

    def start_load(self, req: Request, reserve: int = 0) -> bool | None:
        """Ask the tiers for the blocks past the device's prefix hit. True: the request now waits
        for its load; False: nothing to look up (schedule it as usual); None: not now (no free
        blocks, or another request is loading the same blocks: it will hit them on the device).
        `reserve` blocks stay free for the running requests to grow into: a waiting request must
        not take the blocks they need, as nothing can preempt it."""
        hits, num_hit = self.kv.get_computed_blocks(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        k = len(hits)
        if k >= max_blocks:
            req.tier_looked_up = True
            return False
        if req.block_hashes[k] in self._inflight:
            return None
        num_hits_free = sum(1 for b in hits if self.kv.pool.blocks[b].ref_cnt == 0)
        if self.kv.pool.num_free_blocks - num_hits_free - (max_blocks - k) < reserve:
            return None
        if self.kv.allocate_slots(req, (max_blocks - k) * self.block_size, hits) is None:
            return None
        req.tier_looked_up = True
        req.num_computed_tokens = num_hit
        table = self.kv.block_table(req)
        self._loads.append(TierLoad(req.request_id, req.block_hashes[k:max_blocks], table[k:max_blocks]))
        self._inflight[req.block_hashes[k]] = req.request_id
        self.loading[req.request_id] = req
        return True

    def finish_load(self, result: TierLoadResult) -> Request | None:
        """Count the restored run as computed and register it; the request, or None if it was
        aborted meanwhile (its blocks are freed only now: the copy into them has finished)."""
        req = self.loading.pop(result.request_id)
        k = req.num_computed_tokens // self.block_size
        self._inflight.pop(req.block_hashes[k], None)
        if req.is_finished:
            self.kv.free(req)
            return None
        run = longest_run(result.found)
        self.num_loads += 1
        self.num_restored_tokens += run * self.block_size
        req.num_computed_tokens += run * self.block_size
        req.num_tier_hit_tokens = run * self.block_size
        self.kv.cache_blocks(req)
        # The blocks that stayed empty go back to the pool: the request is admitted again as
        # usual, chunk by chunk, instead of holding blocks for its whole prompt while it waits.
        self.kv.truncate(req, k + run)
        return req
