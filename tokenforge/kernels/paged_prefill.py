"""Varlen causal prefill attention over the paged KV cache (prefix hits and chunks included).

In: q [T, Hq, D] (sequences back to back), kv_cache [2, num_blocks, block_size, Hkv, D] holding
every key of each sequence (cached context and the new tokens, already stored), block_tables
[B, max_blocks] int32, query_start_loc [B+1] int32, seq_lens [B] int32; for an fp8 (e4m3) cache
the layer's kv_scales [4] (kv_quant.py).
Out: out [T, Hq, D]. Sequence i's queries sit at absolute positions
seq_lens[i] - q_len_i .. seq_lens[i] - 1 and each sees every key up to its own position.

Tiling (flash-attention 2 style): a program owns BLOCK_Q consecutive queries of one sequence
times the GROUP query heads of one kv head (rows = BLOCK_Q * GROUP_PAD), so every K/V tile is
read once per group. Key tiles fully below the block's first query run without a causal mask;
only the diagonal tiles build one. Programs map to (sequence, query block) with a binary search
over `query_start_loc // BLOCK_Q + i`, a monotone upper bound, so the grid needs only T and B
and no host-side lengths. An fp8 cache is a compile-time variant (KV_FP8), as in paged_decode.py:
e4m3 tiles are widened to q's dtype, k_scale folds into the softmax scale, v_scale into the output.
A sliding window is a compile-time variant too (SLIDING): query p sees keys p - window + 1 .. p, so
a program starts at the first tile its earliest query's window reaches and masks every tile (a
row may see none of a tile's keys: the running max then stays -inf and must not make NaNs).
Attention sinks (HAS_SINKS, compile-time; gpt-oss): each head's sink logit, which carries no
value, joins the denominator when the output is normalised.
"""

import torch

from ._triton import cdiv, next_power_of_2, require_triton, tl, triton, use_pdl
from .kv_quant import is_fp8

_LOG2E = 1.4426950408889634


@triton.jit
def _find_sequence(query_start_loc_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest i with query_start_loc[i] // BLOCK_Q + i <= pid."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(acc, m, l, q, k_base, bt_row, t, q_pos, seq_len, qk_scale, d, window,
                 stride_c_kv, stride_c_block, stride_c_slot,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, SLIDING: tl.constexpr):
    pos = t * BLOCK_N + tl.arange(0, BLOCK_N)                   # [BLOCK_N] key positions
    valid = pos < seq_len
    block = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    off = block * stride_c_block + (pos % BLOCK_SIZE) * stride_c_slot
    k = tl.load(k_base + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)   # [BLOCK_N, D]
    if KV_FP8:
        k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale              # [BLOCK_M, BLOCK_N]
    if SLIDING:
        seen = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window) & valid[None, :]
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)      # rows that saw no key yet stay at zero
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(s - m_ref[:, None])
    else:
        if CAUSAL_MASK:
            s = tl.where((pos[None, :] <= q_pos[:, None]) & valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    v = tl.load(k_base + stride_c_kv + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    if KV_FP8:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l


# The per-step counts and metadata pointers are not specialised (Triton would compile one variant per
# "== 1" / "divisible by 16" / 16-byte-aligned combination of them: a request could meet a new
# one after start-up). The data pointers and strides keep their specialisation (vector loads). The
# fp8 scales' and sinks' pointers carry seq_lens when unused, so they go unspecialised as well.
@triton.jit(do_not_specialize=["num_seqs", "window", "stride_bt", "block_tables_ptr", "query_start_loc_ptr",
                               "seq_lens_ptr", "scale_ptr", "sinks_ptr"])
def _prefill_kernel(
    q_ptr, kv_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, scale_ptr, sinks_ptr,
    qk_scale, num_seqs, window,
    stride_qt, stride_qh, stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
    stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # programmatic dependent launch: wait for the producer, let the consumer launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, pid, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:                              # slack program of the upper bound
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP_PAD              # query index within the sequence
    heads = kvh * GROUP + rows % GROUP_PAD
    row_mask = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    tok = (q_start + q_idx).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None], other=0.0)              # [BLOCK_M, D]
    q_pos = ctx_len + q_idx                                     # absolute query positions

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_base = kv_ptr + kvh * stride_c_head
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if KV_FP8:
        qk_scale = qk_scale * tl.load(scale_ptr)                # k = code * k_scale
    first_q_pos = ctx_len + q_block * BLOCK_Q
    kv_end = tl.minimum(seq_len, first_q_pos + BLOCK_Q)         # one past the block's last key
    if SLIDING:
        # the earliest query's window starts the range; every tile is masked
        first_tile = tl.maximum(first_q_pos - window + 1, 0) // BLOCK_N
        for t in range(first_tile, tl.cdiv(kv_end, BLOCK_N)):
            acc, m, l = _attend_tile(acc, m, l, q, k_base, bt_row, t, q_pos, seq_len, qk_scale, d, window,
                                     stride_c_kv, stride_c_block, stride_c_slot,
                                     BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, KV_FP8, True)
    else:
        # keys below the block's first query are visible to every row: no mask needed
        full_tiles = first_q_pos // BLOCK_N
        for t in range(0, full_tiles):
            acc, m, l = _attend_tile(acc, m, l, q, k_base, bt_row, t, q_pos, seq_len, qk_scale, d, window,
                                     stride_c_kv, stride_c_block, stride_c_slot,
                                     BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, KV_FP8, False)
        for t in range(full_tiles, tl.cdiv(kv_end, BLOCK_N)):
            acc, m, l = _attend_tile(acc, m, l, q, k_base, bt_row, t, q_pos, seq_len, qk_scale, d, window,
                                     stride_c_kv, stride_c_block, stride_c_slot,
                                     BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, KV_FP8, False)

    den = tl.where(l > 0.0, l, 1.0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        den = l + tl.exp2(sink - m)                             # masked rows: m = -inf -> inf, not stored
    acc = acc / den[:, None]
    if KV_FP8:
        acc = acc * tl.load(scale_ptr + 1)                      # v = code * v_scale
    tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def prefill_config(group_pad: int, head_dim: int, max_query_len: int | None) -> tuple[int, int, int, int]:
    """(BLOCK_Q, BLOCK_N, num_warps, num_stages).

    Measured on an H200 (bench/NOTES.md): 64-row tiles with 4 warps beat 128-row tiles with 8
    warps on 1x2048, 8x512 and a 512-token chunk over a 3584-token prefix.
    """
    block_q = max(1, 64 // group_pad)
    return block_q, 64 if head_dim <= 128 else 32, 4, 2


def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                      max_query_len: int | None = None, out: torch.Tensor | None = None,
                      config: tuple[int, int, int, int] | None = None,
                      kv_scales: torch.Tensor | None = None, sliding_window: int | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention for T new tokens of B sequences over their paged K/V; out [T, Hq, D].
    An fp8 cache needs the layer's kv_scales [4]; `sliding_window`: each query sees its last
    that many keys (itself included); `sinks` [Hq] (fp32): the heads' sink logits."""
    require_triton(q, kv_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    assert q.stride(-1) == 1 and kv_cache.is_contiguous() and head_dim == next_power_of_2(head_dim)
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group_pad = next_power_of_2(group)
    block_q, block_n, num_warps, num_stages = config or prefill_config(group_pad, head_dim, max_query_len)
    grid = (cdiv(num_tokens, block_q) + num_seqs, num_kv_heads)
    fp8 = is_fp8(kv_cache)
    assert not fp8 or kv_scales is not None, "an fp8 KV cache needs its scales"
    _prefill_kernel[grid](
        q, kv_cache, out, block_tables, query_start_loc, seq_lens, kv_scales if fp8 else seq_lens,
        seq_lens if sinks is None else sinks, scale * _LOG2E, num_seqs, sliding_window or 0,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, BLOCK_N=block_n, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_FP8=fp8, SLIDING=sliding_window is not None, HAS_SINKS=sinks is not None, USE_PDL=use_pdl(q),
        num_warps=num_warps, num_stages=num_stages, launch_pdl=use_pdl(q),
    )
    return out
