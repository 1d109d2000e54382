"""The attention backend interface: a KV layout, a metadata builder and a forward.

In: a batch description (`AttentionBatch`, plain per-sequence lists built by the model runner).
Out: the backend's own metadata object (built once per step, shared by every layer) and, per
layer, `forward(q, k, v, kv_cache, metadata) -> out`, which first writes the new k/v into the
paged cache at `slot_mapping` and then attends over the cached context plus the new tokens.

Token order in a batch: sequences are laid out back to back (varlen); sequence i owns rows
`query_start_loc[i] : query_start_loc[i+1]`. Its queries sit at absolute positions
`context_lens[i] .. seq_lens[i]-1`, so prefix-cache hits and chunked prefill (queries that start
mid-sequence) and decodes (one query) are all the same case.

Tree drafts (`TreeMask`, torch backend only): a sequence's queries may instead see the keys before
`base` plus, past it, only the slots its row lists as visible (a draft tree node: its ancestors
and itself). Its new k/v are still written at slots context_len .. seq_len - 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True, slots=True)
class TreeMask:
    """Which keys a sequence's queries see: every key before `base`, and of the keys from `base`
    to its seq_len, those `visible` marks ([query_len, seq_len - base] bool, on the device)."""

    base: int
    visible: torch.Tensor


@dataclass(slots=True)
class AttentionBatch:
    query_lens: list[int]          # new tokens per sequence
    context_lens: list[int]        # tokens already cached per sequence (start position)
    block_tables: list[list[int]]  # per sequence, covering context_len + query_len tokens
    block_size: int
    device: torch.device
    tree_masks: list[TreeMask | None] | None = None   # per sequence (None: causal); None: all causal

    @property
    def seq_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]


class AttentionBackend(Protocol):
    name: str

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's KV tensor; the runner allocates one per layer."""

    def build_metadata(self, batch: AttentionBatch) -> Any:
        """Per-step metadata shared by all layers (slot mapping, block tables, lengths)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: Any, scale: float, kv_scales: torch.Tensor | None = None,
                sliding_window: int | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D]; stores k/v into kv_cache first.
        An fp8 (e4m3) kv_cache needs the layer's kv_scales [4] (kernels/kv_quant.py).
        `sliding_window` (the layer's AttentionSpec): each query sees only its last that many keys."""
