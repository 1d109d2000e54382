"""Per-request block tables over the `BlockPool`, with prefix caching.

In: a `Request` and how many new tokens it will compute. Out: block ids (its block table), or
None when the pool cannot hold them. Only full blocks are ever shared, so a request writes KV only
into blocks that it alone holds. Prefix-cache statistics are counted in tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenforge.core.hashing as hashing
from tokenforge.core.block_pool import BlockPool
from tokenforge.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, block_size, enable_caching)
        self._blocks: dict[str, list[int]] = {}        # request id -> block table
        self._num_registered: dict[str, int] = {}      # request id -> leading blocks in the cache map
        self._num_slots_used: dict[str, int] = {}      # request id -> tokens its slots were allocated for
        self.prefix_cache_queries = 0                  # tokens looked up (cumulative)
        self.prefix_cache_hits = 0                     # tokens found (cumulative)

    # ---- prefix lookup -------------------------------------------------------------------------

    def is_lookup_allowed(self, request: Request) -> bool:
        # Prompt logprobs need the logits of every prompt position, so nothing may be skipped.
        return self.enable_caching and request.params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of the request's tokens: (block ids, number of tokens).

        At most len(tokens) - 1 tokens are reported, so at least one token is computed and its
        logits exist to sample from. Pure: blocks are not touched until `allocate_slots`.
        """
        if not self.is_lookup_allowed(request):
            return [], 0
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        self._update_block_hashes(request, max_blocks)
        bs = self.block_size
        hits: list[int] = []
        for i in range(max_blocks):
            block_id = self.pool.get_cached_block(request.block_hashes[i], tokens[i * bs:(i + 1) * bs])
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * bs

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count a lookup once its request is actually scheduled (not on every retry)."""
        if self.is_lookup_allowed(request):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    # ---- allocation ----------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[int] = ()) -> list[int] | None:
        """Grow the request's block table to cover its computed tokens, the prefix hits in
        `new_computed_blocks`, and `num_new_tokens` more. Returns the newly allocated block ids,
        or None (and changes nothing) when the free blocks cannot cover them."""
        rid = request.request_id
        blocks = self._blocks.get(rid)
        num_held = len(blocks) if blocks is not None else 0
        num_tokens = (request.num_computed_tokens + len(new_computed_blocks) * self.block_size
                      + num_new_tokens)
        num_new_blocks = cdiv(num_tokens, self.block_size) - num_held - len(new_computed_blocks)
        if num_new_blocks <= 0 and blocks is not None and not new_computed_blocks:   # decode fast path
            self._num_slots_used[rid] = num_tokens
            return []
        # Hit blocks that sit on the free list leave it when touched: they are not free for us.
        num_hits_free = sum(1 for b in new_computed_blocks if self.pool.blocks[b].ref_cnt == 0)
        if max(num_new_blocks, 0) > self.pool.num_free_blocks - num_hits_free:
            return None
        if blocks is None:
            blocks = self._blocks[rid] = []
            self._num_registered[rid] = 0
        if new_computed_blocks:
            assert num_held == 0, "prefix hits are only taken before a request holds blocks"
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self._num_registered[rid] = len(new_computed_blocks)   # they are already in the map
        new_ids = self.pool.get_new_blocks(max(num_new_blocks, 0))
        blocks.extend(new_ids)
        self._num_slots_used[rid] = num_tokens
        return new_ids

    def cache_blocks(self, request: Request) -> None:
        """Register the request's blocks that its computed tokens have filled since last time."""
        if not self.enable_caching:
            return
        rid = request.request_id
        # Computed (or queued) tokens whose ids are known: a trailing placeholder is not hashed.
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        start = self._num_registered.get(rid, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request, num_full)
        blocks, tokens, bs = self._blocks[rid], request.all_token_ids, self.block_size
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i], tokens[i * bs:(i + 1) * bs])
        self._num_registered[rid] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so its tail is evicted before its head.

        The block-table list is dropped, not cleared: a `ScheduledSequence` that still refers
        to it keeps a consistent view.
        """
        rid = request.request_id
        blocks = self._blocks.pop(rid, None)
        self._num_registered.pop(rid, None)
        self._num_slots_used.pop(rid, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def truncate(self, request: Request, num_blocks: int) -> None:
        """Free the request's blocks past the first `num_blocks` (unregistered ones: nothing in
        them is computed), so a request does not hold blocks it will not fill soon."""
        blocks = self._blocks.get(request.request_id)
        if not blocks or len(blocks) <= num_blocks:
            return
        assert self._num_registered[request.request_id] <= num_blocks
        tail = blocks[num_blocks:]
        del blocks[num_blocks:]
        self._num_slots_used[request.request_id] = min(self._num_slots_used[request.request_id],
                                                       num_blocks * self.block_size)
        self.pool.free_blocks(reversed(tail))

    def registered_blocks(self, request: Request) -> list[tuple[int, hashing.BlockHash]]:
        """(block id, hash) of the request's leading blocks whose KV is computed and hashed."""
        n = self._num_registered.get(request.request_id, 0)
        return list(zip(self._blocks.get(request.request_id, [])[:n], request.block_hashes[:n]))

    def block_table(self, request: Request) -> list[int]:
        """The request's block ids, by reference (the runner must not mutate it)."""
        return self._blocks.get(request.request_id, [])

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no request holds. Returns how many were forgotten."""
        return self.pool.evict_cached_free_blocks()

    # ---- statistics ----------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def fragmentation(self) -> float:
        """Allocated-but-unused slots (in requests' partly filled tail blocks) / allocated slots."""
        allocated = self.pool.num_used_blocks * self.block_size
        if allocated == 0:
            return 0.0
        bs = self.block_size
        unused = sum(len(self._blocks[rid]) * bs - used for rid, used in self._num_slots_used.items())
        return unused / allocated

    def _update_block_hashes(self, request: Request, num_blocks: int) -> None:
        """Extend request.block_hashes to its first `num_blocks` full blocks. Tokens only ever
        append, so hashes once computed stay valid, even across preemption."""
        have = len(request.block_hashes)
        if have >= num_blocks:
            return
        bs, tokens = self.block_size, request.all_token_ids
        parent = request.block_hashes[-1] if have else request.hash_root
        for i in range(have, num_blocks):
            parent = hashing.hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs], request.cache_salt)
            request.block_hashes.append(parent)
