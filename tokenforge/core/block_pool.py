"""The pool of KV blocks: reference counts, an O(1) LRU free list, and the prefix-cache map.

In: requests for new blocks, touches of cached blocks, frees. Out: block ids (ints that index the
KV tensors' block dimension). A freed block keeps its hash, and so stays findable by prefix
lookup, until the free list hands it out again; only then is its hash evicted. Cached blocks also
remember their token ids, so a hash collision can never hand out a block whose tokens differ.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tokenforge.core.hashing import BlockHash


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None     # set only while registered in the cache map
    token_ids: list[int] | None = None      # the tokens the hash stands for (collision check)

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the front is handed out first. OrderedDict gives O(1)
        # pop-front, append, and removal from the middle (a prefix hit on a free block).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}    # hash -> block id; exactly one block per hash
        # Called with (block id, hash) when a cached block is handed out again, before its KV is
        # overwritten: the KV tiers copy it out. None (the default) costs nothing.
        self.on_evict: Callable[[int, BlockHash], None] | None = None

    # ---- queries -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """Free blocks in the order they would be handed out (for tests and debugging)."""
        return list(self._free)

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """The cached block holding exactly `token_ids` under `block_hash`, or None."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        cached_tokens = self.blocks[block_id].token_ids
        # A colliding hash with other tokens is a miss, never a wrong hit.
        if len(cached_tokens) != len(token_ids) or any(a != b for a, b in zip(cached_tokens, token_ids)):
            return None
        return block_id

    # ---- allocation ----------------------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[int]:
        """Hand out `n` blocks from the front of the free list, each with ref_cnt 1."""
        assert n <= len(self._free), f"asked for {n} blocks, {len(self._free)} free"
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_cnt == 0
            if block.block_hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block_id, block.block_hash)
                self._evict(block)
            block.ref_cnt = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block; a free (cached) block leaves the free list."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the given order.

        Blocks that reach zero join the free list: cached ones at the back (evicted last, LRU),
        uncached ones at the front (nothing to lose by reusing them first). Callers pass a
        request's blocks tail first, so its tail is evicted before its (more shareable) head.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} freed more often than taken"
            if block.ref_cnt == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    # ---- prefix cache --------------------------------------------------------------------------

    def cache_block(self, block_id: int, block_hash: BlockHash, token_ids: list[int]) -> bool:
        """Register a full, computed block under its hash. False when the hash is already taken
        (the same tokens computed twice, or a collision): the first block keeps the entry."""
        if not self.enable_caching or block_hash in self._cached:
            return False
        block = self.blocks[block_id]
        assert block.ref_cnt > 0 and block.block_hash is None
        block.block_hash = block_hash
        block.token_ids = token_ids
        self._cached[block_hash] = block_id
        return True

    def evict_cached_free_blocks(self) -> int:
        """Forget the hashes of all free blocks (e.g. to reset the prefix cache). Returns how many."""
        evicted = 0
        for block_id in self._free:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
                evicted += 1
        return evicted

    def _evict(self, block: KVBlock) -> None:
        assert self._cached.get(block.block_hash) == block.block_id
        del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None
