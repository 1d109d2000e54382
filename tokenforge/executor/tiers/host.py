"""The CPU tier: KV blocks in one preallocated host tensor (pinned on CUDA), with an LRU index.

In: keys and block tensors [L, 2, block_size, kv_heads, head_dim]. Out: views of stored blocks.
Only the tier worker thread writes; a full tier hands its least recently used block to the
caller (to cascade to disk) before reusing the slot.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class HostTier:
    name = "cpu"

    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> None:
        assert num_slots >= 1
        self.store = torch.empty((num_slots, *block_shape), dtype=dtype, pin_memory=pin)  # [S, L, 2, bs, H, D]
        self._index: OrderedDict[str, int] = OrderedDict()     # key -> slot, least recent first
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_slots(self) -> int:
        return self.store.shape[0]

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def get(self, key: str) -> torch.Tensor | None:
        slot = self._index.get(key)
        if slot is None:
            return None
        self._index.move_to_end(key)
        return self.store[slot]

    def put(self, key: str, block: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """Store a block; returns (key, a copy of its data) of the block it displaced, if any."""
        if key in self._index:
            self._index.move_to_end(key)
            return None
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            old_key, slot = self._index.popitem(last=False)
            evicted = (old_key, self.store[slot].clone())
        self.store[slot].copy_(block)
        self._index[key] = slot
        return evicted
