"""The rows of one multi-LoRA step grouped by adapter slot, for kernels/lora.py's shrink and expand.

In: indices [T] (each row's slot, -1 for the base model) and the slot count S. Out: a LoRAPlan, made
on the device with no host sync (a stable sort of the indices and a table of tiles, each at most
BLOCK_M rows of one slot), whose shapes depend on T and S alone, so CUDA graphs replay it. Made
once a step by the first LoRA linear and shared by the others (model/layers/lora.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._triton import next_power_of_2


class LoRAPlan(NamedTuple):
    """Rows grouped by slot: `rows` [T] the row order (base rows first, then each slot's rows in
    order), and per tile its slot (-1: unused), first position in `rows`, and row count."""
    rows: torch.Tensor
    tile_slot: torch.Tensor
    tile_start: torch.Tensor
    tile_count: torch.Tensor
    block_m: int
    counters: torch.Tensor      # [tiles * MAX_RANK_BLOCKS] int32, zero between the shrink's launches


MAX_RANK_BLOCKS = 16            # rank blocks of 64 a linear's packed rank may take (3 slices of R = 256)


def lora_block_m(num_tokens: int, num_slots: int = 1) -> int:
    """BLOCK_M, the rows a tile: 16 while the slots average at most 16 rows each (a decode batch
    spread over many adapters: 32-row tiles would run half empty), else by the step's size."""
    if num_tokens <= 128 or num_tokens <= 16 * num_slots:
        return 16
    return 32 if num_tokens <= 1024 else 64


def plan_tiles(num_tokens: int, num_slots: int) -> int:
    """The plan's fixed tile count for a step of `num_tokens` rows over `num_slots` slots (each
    slot's rows may leave one tile part-filled)."""
    return _cdiv(num_tokens, lora_block_m(num_tokens, num_slots)) + min(num_slots, num_tokens)


def rank_block(packed_rank: int) -> int:
    """BLOCK_R: the shrink's rank columns a program."""
    return min(64, next_power_of_2(packed_rank))


def lora_plan(indices: torch.Tensor, num_slots: int, block_m: int | None = None) -> LoRAPlan:
    """The tiles of one step's rows (device ops only, no host sync; shapes depend on T and S alone);
    `block_m`, the rows a tile (default: `lora_block_m`'s choice for T)."""
    num_tokens = indices.shape[0]
    block_m = block_m or lora_block_m(num_tokens, num_slots)
    idx = indices.to(torch.int32)
    rows = torch.sort(idx, stable=True).indices.to(torch.int32)                        # base rows (-1) first
    counts = (idx[:, None] == torch.arange(num_slots, device=idx.device, dtype=torch.int32)).sum(0, dtype=torch.int32)
    seg_end = torch.cumsum(counts, 0, dtype=torch.int32) + (num_tokens - counts.sum(dtype=torch.int32))
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0, dtype=torch.int32)
    max_tiles = _cdiv(num_tokens, block_m) + min(num_slots, num_tokens)
    t = torch.arange(max_tiles, device=idx.device, dtype=torch.int32)
    slot = torch.searchsorted(tile_end, t, right=True).to(torch.int32)                # num_slots: unused
    valid = slot < num_slots
    s = slot.clamp(max=num_slots - 1).long()
    local = t - (tile_end[s] - tiles[s])
    start = seg_end[s] - counts[s] + local * block_m
    count = torch.clamp(counts[s] - local * block_m, max=block_m)
    return LoRAPlan(rows, torch.where(valid, slot, -1), start.to(torch.int32),
                    torch.where(valid, count, 0).to(torch.int32), block_m,
                    torch.zeros(max_tiles * MAX_RANK_BLOCKS, dtype=torch.int32, device=idx.device))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["MAX_RANK_BLOCKS", "LoRAPlan", "lora_block_m", "lora_plan", "plan_tiles", "rank_block"]
