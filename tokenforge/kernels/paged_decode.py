"""Decode attention (one query per sequence) over the paged KV cache: split-KV, GQA-grouped.

In: q [B, Hq, D], kv_cache [2, num_blocks, block_size, Hkv, D], block_tables [B, max_blocks]
int32, seq_lens [B] int32 (the new token's k/v already stored; seq_len 0 = padding row); for an
fp8 (e4m3) cache, the layer's kv_scales [4] (kv_quant.py).
Out: out [B, Hq, D].

One program per (sequence, kv head, split). The GROUP query heads that share a kv head are the
rows of one tile, so each K/V tile is read from HBM once per group, and the tile is a tensor-core
dot ([GROUP_PAD, D] x [D, BLOCK_N]). Splits (flash-decoding) give a batch-1 decode enough
programs to pull full bandwidth; each split writes a partial output and its log-sum-exp, and a
second kernel merges them (a sequence that fits one split is written directly and the merge
skips it; a batch big enough to fill the GPU gets one split and no second launch).
CUDA-graph safe: the grid is (B, Hkv, num_splits) for a given batch size; each program derives
its key range from seq_lens on the device and exits early when its split is empty, so nothing
depends on host-side lengths. Measured choices (H200, bench/NOTES.md): BLOCK_N 64, 4 warps,
2 stages with splits / 3 stages without. An in-kernel merge by the last split (atomic ticket)
was tried and was slower at every batch-1 length, so it is not here.
An fp8 cache is a compile-time variant (KV_FP8): tiles are read as e4m3 (half the bytes) and
widened to q's dtype before the dots; k_scale folds into the softmax scale and v_scale into the
output, so dequantizing costs no extra multiply per element. The bf16 variant is unchanged.
A sliding window (SLIDING, compile-time) moves the key range to the last `window` positions, found
on the device from seq_lens like the rest, so the splits share only the window's tiles and a
graph captured for a layer keeps its window (a launch argument).
Attention sinks (HAS_SINKS, compile-time; gpt-oss): one more logit per head with no value joins
the softmax's denominator, added where the output is normalised: in the split kernel when it
writes the output itself, else once in the merge.
"""

import torch

from ._triton import cdiv, next_power_of_2, require_triton, tl, triton, use_pdl
from .kv_quant import is_fp8

_LOG2E = 1.4426950408889634
_SM_COUNT: dict[int, int] = {}


@triton.jit
def _key_tiles(seq_len, window, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr):
    """(first key, first tile, tile count) of the keys the sequence's newest query sees."""
    if SLIDING:
        key_lo = tl.maximum(seq_len - window, 0)
    else:
        key_lo = seq_len * 0
    first_tile = key_lo // BLOCK_N
    return key_lo, first_tile, tl.cdiv(seq_len, BLOCK_N) - first_tile


# Per-step counts and metadata pointers unspecialised, as in paged_prefill (eager decode batches
# past the captured buckets would otherwise meet new variants after start-up). scale_ptr and
# sinks_ptr too: without fp8 scales or sinks they carry seq_lens, whose alignment in an eager
# batch's packed metadata varies with the batch (the EAGLE head's eager decodes compiled both
# kernels at a first request, device log round 24).
@triton.jit(do_not_specialize=["num_splits", "window", "stride_bt", "block_tables_ptr", "seq_lens_ptr", "scale_ptr",
                               "sinks_ptr"])
def _decode_split_kernel(
    q_ptr, kv_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr, scale_ptr, sinks_ptr,
    qk_scale, num_splits, window,
    stride_qb, stride_qh, stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
    stride_bt, stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr, SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # programmatic dependent launch: wait for the previous kernel, let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    key_lo, first_tile, num_tiles = _key_tiles(seq_len, window, BLOCK_N, SLIDING)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    active = tl.cdiv(num_tiles, tl.maximum(tiles_per_split, 1))  # splits with keys
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, first_tile + num_tiles)
    if not SINGLE_SPLIT:
        # splits without keys exit; split 0 stays even for a padding row (it writes the zeros)
        if split >= tl.maximum(active, 1):
            return

    rows = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + rows                                  # [GROUP_PAD] query heads
    row_mask = rows < GROUP
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None], other=0.0)              # [GROUP_PAD, D]

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)        # running max (log2 units)
    l = tl.zeros([GROUP_PAD], tl.float32)                       # running sum of exp2
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    k_base = kv_ptr + kvh * stride_c_head
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    if KV_FP8:
        qk_scale = qk_scale * tl.load(scale_ptr)                # k = code * k_scale
    for t in range(tile_lo, tile_hi):
        pos = t * BLOCK_N + tl.arange(0, BLOCK_N)               # [BLOCK_N] key positions
        valid = pos < seq_len
        if SLIDING:
            valid = valid & (pos >= key_lo)                     # every tile keeps at least one key
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        off = block * stride_c_block + (pos % BLOCK_SIZE) * stride_c_slot
        k = tl.load(k_base + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_N, D]
        if KV_FP8:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale          # [GROUP_PAD, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(k_base + stride_c_kv + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    l_safe = tl.where(l > 0.0, l, 1.0)                          # seq_len 0 (padding) -> zeros
    den = l_safe
    if HAS_SINKS:   # the sink joins the denominator where this program writes the output itself
        sink = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        with_sink = l + tl.exp2(sink - m)                       # padding: m = -inf -> inf -> zeros
        if SINGLE_SPLIT:
            den = with_sink
        else:
            den = tl.where(active <= 1, with_sink, l_safe)
    acc = acc / den[:, None]
    if KV_FP8:
        acc = acc * tl.load(scale_ptr + 1)                      # v = code * v_scale
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
    if SINGLE_SPLIT:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    elif active <= 1:                                           # whole sequence (or padding) in this split
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        # partials: part_out [B, Hq, num_splits, D], part_lse [B, Hq, num_splits] (log2 units)
        part_row = (b.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * num_splits + split
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + d[None, :], acc, mask=row_mask[:, None])
        tl.store(part_lse_ptr + part_row, m + tl.log2(l_safe), mask=row_mask)


@triton.jit
def _merge_head(part_out_ptr, part_lse_ptr, row0, active, o_ptr, sink, SPLITS_PAD: tl.constexpr,
                HEAD_DIM: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Log-sum-exp merge of one head's `active` partials (rows row0 .. row0+active-1) into o_ptr;
    with HAS_SINKS the head's sink logit (log2 units) joins the denominator."""
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    smask = s < active
    lse = tl.load(part_lse_ptr + row0 + s, mask=smask, other=float("-inf"))
    parts = tl.load(part_out_ptr + (row0 + s)[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None], other=0.0)
    top = tl.max(lse, axis=0)
    w = tl.where(smask, tl.exp2(lse - top), 0.0)
    den = tl.sum(w, axis=0)
    if HAS_SINKS:
        den += tl.exp2(sink - top)
    o = tl.sum(parts * w[:, None], axis=0) / tl.where(den > 0.0, den, 1.0)
    tl.store(o_ptr + d, o.to(o_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["num_splits", "window", "seq_lens_ptr", "sinks_ptr"])
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, seq_lens_ptr, out_ptr, sinks_ptr, num_splits, window, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS_PAD: tl.constexpr, SLIDING: tl.constexpr,
    HAS_SINKS: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    _, _, num_tiles = _key_tiles(seq_len, window, BLOCK_N, SLIDING)
    active = tl.cdiv(num_tiles, tl.maximum(tl.cdiv(num_tiles, num_splits), 1))  # splits that wrote partials
    if active <= 1:                                             # the split kernel wrote the output
        return
    sink = 0.0
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
    _merge_head(part_out_ptr, part_lse_ptr, (b.to(tl.int64) * tl.num_programs(1) + h) * num_splits, active,
                out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh, sink, SPLITS_PAD, HEAD_DIM, HAS_SINKS)


def choose_num_splits(batch_size: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per (sequence, kv head) so that the grid fills the GPU about 4 times over.

    Depends only on the batch size (never on lengths), so a CUDA graph captured for a batch
    size keeps a valid grid; programs of unused splits exit at once.
    """
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    programs = max(1, batch_size * num_kv_heads)
    return max(1, min(64, next_power_of_2(cdiv(4 * _SM_COUNT[idx], programs))))


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                     out: torch.Tensor | None = None, block_n: int = 64, num_warps: int = 4,
                     num_stages: int | None = None, kv_scales: torch.Tensor | None = None,
                     sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D] -> out [B, Hq, D], attending to seq_lens[b] cached keys of each sequence (the
    last `sliding_window` of them with a window). An fp8 cache needs the layer's kv_scales [4];
    `sinks` [Hq] (fp32) are the heads' sink logits."""
    require_triton(q, kv_cache)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_q_heads // num_kv_heads
    assert q.stride(-1) == 1 and kv_cache.is_contiguous() and head_dim == next_power_of_2(head_dim)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    splits = num_splits or choose_num_splits(batch, num_kv_heads, q.device)
    single = splits == 1
    if num_stages is None:  # measured: 3 stages pay when a program walks many tiles (large batch)
        num_stages = 3 if single else 2
    if single:
        part_out = part_lse = out                               # unused
    else:
        part_out = torch.empty(batch, num_q_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_q_heads, splits, dtype=torch.float32, device=q.device)
    fp8 = is_fp8(kv_cache)
    assert not fp8 or kv_scales is not None, "an fp8 KV cache needs its scales"
    pdl = use_pdl(q)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, kv_cache, block_tables, seq_lens, out, part_out, part_lse, kv_scales if fp8 else seq_lens,
        seq_lens if sinks is None else sinks, scale * _LOG2E, splits, sliding_window or 0,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, SINGLE_SPLIT=single, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_FP8=fp8, SLIDING=sliding_window is not None, HAS_SINKS=sinks is not None, USE_PDL=pdl,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl,
    )
    if not single:
        _decode_reduce_kernel[(batch, num_q_heads)](
            part_out, part_lse, seq_lens, out, seq_lens if sinks is None else sinks, splits, sliding_window or 0,
            out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_N=block_n, SPLITS_PAD=next_power_of_2(splits),
            SLIDING=sliding_window is not None, HAS_SINKS=sinks is not None, USE_PDL=pdl,
            num_warps=4, launch_pdl=pdl,
        )
    return out
