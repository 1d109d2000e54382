"""Decode workspaces: contiguous per-layer K/V mirrors of the running decode batch (CPU path).

Why: on the CPU, gathering every decode sequence's K/V out of the paged cache costs more than the
attention itself, and it is repeated by every layer at every step although each step adds only
one token per sequence. A workspace keeps the gathered K/V of the decode batch, head-major and
contiguous ([2, B, Hkv, capacity, D]) per layer; a step that continues the previous one (same
sequences, in the same order, each one token further, block tables only grown) appends the new
token in place, and anything else rebuilds it with one gather. The paged cache stays the source
of truth: every new token is written there too, so a rebuild is always possible.

In: the step's decode block tables and context lengths (`plan`, once per step), then per layer
the grouped queries and the new k/v (`attend`). Out: attention output, or None when the
workspace would exceed its memory cap (the caller then gathers as usual).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MAX_BYTES_PER_LAYER = 64 * 2**20
_GROWTH = 64          # spare token slots per rebuild, so appends rarely outgrow the capacity
_MAX_GROUPS = 4       # attention calls per layer for one decode batch, by descending length
_MIN_GROUP = 8


def _group_bounds(batch: int) -> list[tuple[int, int]]:
    num = max(1, min(_MAX_GROUPS, batch // _MIN_GROUP))
    edges = [round(i * batch / num) for i in range(num + 1)]
    return list(zip(edges[:-1], edges[1:]))


@dataclass(slots=True)
class _LayerWorkspace:
    kv: torch.Tensor      # [2, B, Hkv, capacity, D]
    step: int             # the step whose token was appended last


class DecodeWorkspaces:
    def __init__(self, max_bytes_per_layer: int = MAX_BYTES_PER_LAYER) -> None:
        self.max_bytes = max_bytes_per_layer
        self.step = 0
        self.continues = False
        self._prev: list[tuple[list[int], int]] | None = None
        self._layers: dict[int, _LayerWorkspace] = {}
        self.order: list[int] = []
        self._order_t = torch.empty(0, dtype=torch.int64)
        self.groups: list[tuple[int, int, int]] = []
        self.identity = False
        self._context_lens: list[int] = []

    def plan(self, tables: list[list[int]], context_lens: list[int]) -> None:
        """Once per step: does this decode batch continue the previous step's, token for token?
        A new batch is laid out longest first and cut into groups, so each group's attention
        reads only up to its own longest context instead of the whole batch's."""
        self.step += 1
        prev = self._prev
        self.continues = prev is not None and len(prev) == len(tables) and all(
            ctx == p_ctx + 1 and table[:len(p_table)] == p_table
            for table, ctx, (p_table, p_ctx) in zip(tables, context_lens, prev))
        self._prev = [(list(t), c) for t, c in zip(tables, context_lens)]
        self._context_lens = list(context_lens)
        if not self.continues:
            self.order = sorted(range(len(context_lens)), key=lambda i: -context_lens[i])
            self._order_t = torch.tensor(self.order, dtype=torch.int64)
            # Already longest first (always for one sequence): attend skips every reordering copy.
            self.identity = self.order == list(range(len(self.order)))
        bounds = _group_bounds(len(self.order))
        self.groups = [(start, end, context_lens[self.order[start]] + 1) for start, end in bounds]

    def attend(self, grouped_q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, kv_cache: torch.Tensor,
               block_ids: torch.Tensor, context_lens: torch.Tensor, max_len: int, key_mask: torch.Tensor | None,
               scale: float) -> torch.Tensor | None:
        """grouped_q [B, Hkv, G, D]; k_new/v_new [B, Hkv, D] -> [B, Hkv, G, D], or None past the cap."""
        batch = grouped_q.shape[0]
        identity = self.identity
        order = None if identity else self._order_t.to(grouped_q.device)
        key = kv_cache.data_ptr()
        ws = self._layers.get(key)
        reusable = (ws is not None and self.continues and ws.step == self.step - 1
                    and ws.kv.shape[1] == batch and ws.kv.shape[3] >= max_len)
        if reusable and batch == 1:
            pos = self._context_lens[0]
            ws.kv[0, 0, :, pos] = k_new[0]                 # [Hkv, D] at the sequence's new position
            ws.kv[1, 0, :, pos] = v_new[0]
        elif reusable:
            rows = torch.arange(batch, device=k_new.device)
            positions = context_lens if identity else context_lens[order]
            ws.kv[0, rows, :, positions] = k_new if identity else k_new[order]   # [B, Hkv, D] at each new position
            ws.kv[1, rows, :, positions] = v_new if identity else v_new[order]
        else:
            sorted_blocks = block_ids if identity else block_ids.view(batch, -1)[order].reshape(-1)
            ws = self._rebuild(kv_cache, sorted_blocks, batch, max_len)
            if ws is None:
                self._layers.pop(key, None)
                return None
            self._layers[key] = ws
        ws.step = self.step
        q_sorted = grouped_q if identity else grouped_q[order]
        mask_sorted = key_mask if key_mask is None or identity else key_mask[order]
        parts = []
        for start, end, length in self.groups:
            keys, values = ws.kv[0, start:end, :, :length], ws.kv[1, start:end, :, :length]   # [b, Hkv, L, D]
            mask = mask_sorted[start:end, :, :, :length] if mask_sorted is not None else None
            parts.append(F.scaled_dot_product_attention(q_sorted[start:end], keys, values, attn_mask=mask,
                                                        scale=scale))
        joined = torch.cat(parts) if len(parts) > 1 else parts[0]
        if identity:
            return joined
        out = torch.empty_like(grouped_q)
        out[order] = joined
        return out

    def _rebuild(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, batch: int,
                 max_len: int) -> _LayerWorkspace | None:
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        capacity = max_len + _GROWTH
        if 2 * batch * num_kv_heads * capacity * head_dim * kv_cache.element_size() > self.max_bytes:
            return None
        max_blocks = block_ids.numel() // batch
        gathered = kv_cache.index_select(1, block_ids).view(2, batch, max_blocks * block_size, num_kv_heads, head_dim)
        kv = kv_cache.new_zeros(2, batch, num_kv_heads, capacity, head_dim)
        length = min(max_len, max_blocks * block_size)
        kv[:, :, :, :length].copy_(gathered[:, :, :length].transpose(2, 3))
        return _LayerWorkspace(kv, self.step)
