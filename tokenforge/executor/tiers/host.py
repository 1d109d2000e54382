"""The CPU tier: KV blocks in one preallocated host tensor (pinned on CUDA), with an LRU index.

In: block hashes. Out: slots, the indexes of the blocks in `store` [S, L, 2, block_size, kv_heads,
head_dim]. Only the engine thread reads or changes the index: a save takes its slots at once and
its device-to-host copy lands in them on the save stream, so a later load of the same hash finds
it (its copy is ordered after the save's on the device). A full tier reuses its least recently
used slot and names the block it displaced (to cascade to disk).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch


class HostTier:
    name = "cpu"

    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> None:
        assert num_slots >= 1
        self.store = torch.empty((num_slots, *block_shape), dtype=dtype, pin_memory=pin)  # [S, L, 2, bs, H, D]
        self._index: OrderedDict[bytes, int] = OrderedDict()     # hash -> slot, least recent first
        self._free = list(range(num_slots - 1, -1, -1))          # popped in ascending order

    @property
    def num_slots(self) -> int:
        return self.store.shape[0]

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def lookup(self, keys: Sequence[bytes]) -> list[int | None]:
        """The slot of each key, or None. Marks the hits used, the first key last: a prefix's head
        is needed by every request that uses any of it, so its tail leaves the tier first."""
        slots = [self._index.get(key) for key in keys]
        for key, slot in zip(reversed(keys), reversed(slots)):
            if slot is not None:
                self._index.move_to_end(key)
        return slots

    def get(self, key: bytes) -> torch.Tensor | None:
        slot = self.lookup([key])[0]
        return self.store[slot] if slot is not None else None

    def reserve(self, key: bytes) -> tuple[int, bytes | None] | None:
        """A slot for a new block: (slot, the key it displaced or None); None when already held."""
        if key in self._index:
            self._index.move_to_end(key)
            return None
        displaced = None
        if self._free:
            slot = self._free.pop()
        else:
            displaced, slot = self._index.popitem(last=False)
        self._index[key] = slot
        return slot, displaced

    def put(self, key: bytes, block: torch.Tensor) -> tuple[bytes, torch.Tensor] | None:
        """Store a block synchronously; returns (key, a copy of its data) of the block it displaced."""
        got = self.reserve(key)
        if got is None:
            return None
        slot, displaced = got
        evicted = (displaced, self.store[slot].clone()) if displaced is not None else None
        self.store[slot].copy_(block)
        return evicted
