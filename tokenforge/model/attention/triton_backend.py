"""Triton attention backend: the GPU path over the paged KV cache.

In: an `AttentionBatch` per step (plain lists from the model runner). Out: a
`TritonAttentionMetadata` shared by every layer, and per layer `forward(q, k, v, kv_cache,
metadata, scale)`, which stores the new k/v at `slot_mapping` and then runs either the split-KV
decode kernel (every sequence has one new token) or the varlen prefill kernel (anything else:
prefill, prefix-cache hits, chunked prefill, mixed prefill + decode).

CUDA graphs. Decode graphs replay kernels whose inputs must stay at fixed addresses, so the
runner preallocates one `DecodeMetadataBuffers` (sized for its largest captured batch) and,
before every capture and every replay, refills it in place:

    buffers = DecodeMetadataBuffers(max_batch_size=256, max_blocks_per_seq=512, device=dev)
    meta = backend.build_metadata(batch, out=buffers, padded_batch_size=graph_batch_size)
    # or: meta = buffers.fill(batch, padded_batch_size=graph_batch_size)

`meta`'s tensors are views at the start of the persistent buffers, so their addresses depend
only on the padded batch size. Rows past the real batch are padding: seq_len 0, slot -1 (no
store) and an all-zero attention output. The decode launch depends only on shapes (batch size,
heads): the split count is a function of the batch size and each program reads its lengths on
the device, so one capture per batch size serves every sequence length.

Kernels launch with programmatic dependent launch on sm90+ (see kernels/_triton.py `set_pdl`):
that is captured into graphs too, and hides most of each small kernel's launch latency.
`forward(..., kv_stored=True)` skips the k/v store when `kernels.rotary.apply_rotary` already
stored them (its fused variant), which saves one launch per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenforge.kernels.kv_store import store_kv
from tokenforge.kernels.paged_attention import choose_num_splits, decode_attention, prefill_attention
from tokenforge.model.attention.backend import AttentionBatch


@dataclass(slots=True)
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor     # [T] int32, flat cache slot per new token, -1 = padding
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor         # [B] int32, context + new tokens (0 = padding row)
    context_lens: torch.Tensor     # [B] int32, tokens already cached
    block_tables: torch.Tensor     # [B, max_blocks] int32, zero padded
    num_seqs: int                  # B, padding rows included
    num_tokens: int                # T
    max_query_len: int
    max_seq_len: int
    is_decode_only: bool           # every row has one query: the split-KV decode kernel runs


def _pack_host(batch: AttentionBatch, num_rows: int, num_cols: int) -> np.ndarray:
    """One int32 array [slots(T) | seq_lens(R) | context_lens(R) | block_tables(R * C)].

    Rows past the batch are padding (seq_len 0); T = sum(query_lens) + padding rows when the
    batch is a decode batch padded to num_rows.
    """
    bs = batch.block_size
    qlens = np.asarray(batch.query_lens, dtype=np.int64)
    ctx = np.asarray(batch.context_lens, dtype=np.int64)
    n = len(qlens)
    tables = np.zeros((num_rows, num_cols), dtype=np.int32)
    i = 0
    while i < n:        # rows sharing one table object (a sequence's decode rows) are written at once
        row, j = batch.block_tables[i], i + 1
        while j < n and batch.block_tables[j] is row:
            j += 1
        tables[i:j, : len(row)] = row
        i = j
    seq_idx = np.repeat(np.arange(n), qlens)                  # [T] owning sequence per token
    starts = np.concatenate(([0], np.cumsum(qlens)[:-1])) if n else np.zeros(0, np.int64)
    pos = np.arange(int(qlens.sum())) - starts[seq_idx] + ctx[seq_idx]
    slots = tables[seq_idx, pos // bs].astype(np.int64) * bs + pos % bs
    pad_tokens = num_rows - n if np.all(qlens == 1) else 0
    lens = np.zeros((2, num_rows), dtype=np.int32)
    lens[0, :n], lens[1, :n] = ctx + qlens, ctx
    return np.concatenate([slots.astype(np.int32), np.full(pad_tokens, -1, np.int32), lens.ravel(), tables.ravel()])


FULL_WIDTH_SLACK = 32768    # unused table entries a fill may copy (128 KB) to stay one contiguous copy


class DecodeMetadataBuffers:
    """Persistent device buffers that decode metadata is written into (CUDA-graph inputs)."""

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device | str):
        self.max_batch_size, self.max_blocks = max_batch_size, max_blocks_per_seq
        r = max_batch_size
        # one int32 allocation so a refill is one host-to-device copy
        self.storage = torch.zeros(3 * r + r * max_blocks_per_seq, dtype=torch.int32, device=device)
        self.storage[:r].fill_(-1)
        self.slot_mapping = self.storage[:r]                          # [R]
        self.seq_lens = self.storage[r: 2 * r]                        # [R]
        self.context_lens = self.storage[2 * r: 3 * r]                # [R]
        self.block_tables = self.storage[3 * r:].view(r, max_blocks_per_seq)  # [R, C]
        self.query_start_loc = torch.arange(r + 1, dtype=torch.int32, device=device)  # fixed for decode

    def fill(self, batch: AttentionBatch, padded_batch_size: int | None = None) -> TritonAttentionMetadata:
        """Write a decode batch (every query_len 1) into the buffers; rows past it are padding."""
        n = len(batch.query_lens)
        rows = padded_batch_size or n
        assert all(q == 1 for q in batch.query_lens), "DecodeMetadataBuffers holds decode batches only"
        assert n <= rows <= self.max_batch_size, f"batch {n} / padded {rows} exceeds {self.max_batch_size}"
        used = max((len(t) for t in batch.block_tables), default=1) or 1
        assert used <= self.max_blocks, "block table wider than buffers"
        # A row never reads past its own table (its seq_len masks the rest), so only the columns the
        # batch uses need writing; the full width is max_model_len / block_size (8,192 at 128k
        # tokens). One contiguous copy of the full width while that is small (a second copy costs
        # ~10 us of host time a step), else the used columns alone.
        cols = self.max_blocks if rows * (self.max_blocks - used) <= FULL_WIDTH_SLACK else used
        packed = _pack_host(batch, rows, cols)              # [slots(rows) | lens(2*rows) | tables]
        r = self.max_batch_size
        host = np.zeros(3 * r + (rows * cols if cols == self.max_blocks else 0), dtype=np.int32)
        host[:r] = -1                                       # slots past the batch store nothing
        host[:rows] = packed[:rows]
        host[r: r + rows] = packed[rows: 2 * rows]
        host[2 * r: 2 * r + rows] = packed[2 * rows: 3 * rows]
        # pageable sources: each call returns once its data is staged, so the arrays may be freed
        if cols == self.max_blocks:
            host[3 * r:] = packed[3 * rows:]
            self.storage[: host.size].copy_(torch.from_numpy(host), non_blocking=True)
        else:
            self.storage[: 3 * r].copy_(torch.from_numpy(host), non_blocking=True)
            tables = torch.from_numpy(packed[3 * rows:].reshape(rows, cols))
            self.block_tables[:rows, :cols].copy_(tables, non_blocking=True)
        seq_lens = [c + 1 for c in batch.context_lens]
        return TritonAttentionMetadata(
            slot_mapping=self.slot_mapping[:rows], query_start_loc=self.query_start_loc[: rows + 1],
            seq_lens=self.seq_lens[:rows], context_lens=self.context_lens[:rows],
            block_tables=self.block_tables[:rows], num_seqs=rows, num_tokens=rows, max_query_len=1,
            max_seq_len=max(seq_lens, default=0), is_decode_only=True,
        )


class TritonAttentionBackend:
    name = "triton"
    supports_sinks = True

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @staticmethod
    def decode_variant(batch_size: int, num_kv_heads: int, device: torch.device) -> int:
        """What compiles a separate decode kernel for a batch size: its split count (a constexpr
        of the reduce kernel). The warm-up runs one eager decode per value (executor/warmup.py)."""
        return choose_num_splits(batch_size, num_kv_heads, device)

    def build_metadata(self, batch: AttentionBatch, out: DecodeMetadataBuffers | None = None,
                       padded_batch_size: int | None = None) -> TritonAttentionMetadata:
        """Per-step metadata; with `out`, a decode batch is written into persistent buffers."""
        if out is not None:
            return out.fill(batch, padded_batch_size)
        if batch.tree_masks is not None and any(m is not None for m in batch.tree_masks):
            raise NotImplementedError("the triton backend has no tree attention kernel (tree drafts run on torch)")
        n = len(batch.query_lens)
        cols = max((len(t) for t in batch.block_tables), default=1) or 1
        packed = torch.from_numpy(_pack_host(batch, n, cols)).to(batch.device, non_blocking=True)
        num_tokens = sum(batch.query_lens)
        query_start_loc = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(batch.query_lens, out=query_start_loc[1:])
        seq_lens = batch.seq_lens
        return TritonAttentionMetadata(
            slot_mapping=packed[:num_tokens],
            query_start_loc=torch.from_numpy(query_start_loc).to(batch.device, non_blocking=True),
            seq_lens=packed[num_tokens: num_tokens + n], context_lens=packed[num_tokens + n: num_tokens + 2 * n],
            block_tables=packed[num_tokens + 2 * n:].view(n, cols), num_seqs=n, num_tokens=num_tokens,
            max_query_len=max(batch.query_lens, default=0), max_seq_len=max(seq_lens, default=0),
            is_decode_only=n > 0 and all(q == 1 for q in batch.query_lens),
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TritonAttentionMetadata, scale: float, kv_stored: bool = False,
                kv_scales: torch.Tensor | None = None, sliding_window: int | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]. `kv_stored`: the rotary kernel already stored k/v.
        `kv_scales` [4]: the layer's fp8 scales (an fp8 cache only). `sliding_window`: the layer's
        window, a kernel argument (the metadata holds whole sequences; kernels skip the keys
        before each query's window), so one metadata and one set of decode graphs serve every layer.
        `sinks` [Hq]: the layer's attention-sink logits (gpt-oss), a kernel argument too."""
        if not kv_stored:
            store_kv(k, v, kv_cache, metadata.slot_mapping, kv_scales)
        if metadata.is_decode_only:
            assert q.shape[0] == metadata.num_seqs, "decode q rows must match the (padded) batch"
            return decode_attention(q, kv_cache, metadata.block_tables, metadata.seq_lens, scale,
                                    kv_scales=kv_scales, sliding_window=sliding_window, sinks=sinks)
        return prefill_attention(q, kv_cache, metadata.block_tables, metadata.query_start_loc,
                                 metadata.seq_lens, scale, max_query_len=metadata.max_query_len,
                                 kv_scales=kv_scales, sliding_window=sliding_window, sinks=sinks)
