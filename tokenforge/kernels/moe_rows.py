"""MXFP4 MoE GEMMs over a few rows an expert: each weight tile decoded once, then multiplied by
every row of the expert's block with plain fused multiply-adds.

A 128-token prefill of gpt-oss routes 512 pairs: 4 rows an expert on 120b (128 experts), 16 on
20b (32). The grouped GEMM of kernels/moe.py lays each decoded MXFP4 tile out as an MMA operand,
which costs more than the decode itself; on an H100 its two launches took 97 of 103 ms of
120b's W1 prefill, some 20% of the read rate (bench/moe_prefill_profile.py, BENCHMARKS round 20).
The GEMV path (kernels/moe_gemv.py) decodes without that layout but once per pair, so a tile
shared by 4-16 pairs is decoded 4-16 times. Here a program takes one block of `align`'s sorted
pairs (rows of one expert) and a column tile: per K step it decodes the tile's code words once
(`fp4_word`, inline PTX on the GPU), then walks the block's live rows, each an FMA per value
against that row's activations, the group sums reduced and added to the row's accumulator.

In: `fused_moe`'s arguments with `align`'s layout at block size `ROWS_BLOCK_M`. Out: the GEMM's
rows, with the epilogues of the other two paths (biases, SwiGLU or gpt-oss's clamped form,
routing weights). `rows_path` says when a batch takes it: MXFP4 experts, past the GEMV path's
pair count, while an expert averages at most `ROWS_PER_EXPERT` rows.
"""

from __future__ import annotations

import torch

from tokenforge import envs

from ._triton import _interpreting, tl, triton, use_pdl
from .moe_gemv import DECODE_ASM, MOE_PDL, fp4_acts, fp4_scale, fp4_word, swiglu

ROWS_BLOCK_M = 16          # rows of one expert a program walks (align pads each expert's run to it)
ROWS_PER_EXPERT = 32       # the most rows an expert averages (pairs / experts) for this path
ROWS_TILE = (32, 256, 4)   # BLOCK_N, BLOCK_K, warps: the GEMV's [groups, rows] thread grid, half its K step
ENABLED = envs.moe_rows()


def rows_path(fmt: str, pairs: int, num_experts: int) -> bool:
    return ENABLED and fmt == "mxfp4" and pairs <= ROWS_PER_EXPERT * num_experts


@triton.jit
def _rows_dot(a_ptr, w_ptr, s_ptr, ids_ptr, count, rows, mask_n, rows_per_a, K, stride_am, stride_wn, stride_sn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A_WORDS: tl.constexpr,
              ASM: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32: row m (< count) is the activation row of pair ids_ptr[m] times
    the MXFP4 rows at `rows`; rows past `count` stay 0."""
    G: tl.constexpr = BLOCK_K // 32
    g = tl.arange(0, G)
    q = tl.arange(0, 4)
    row_off = tl.multiple_of(rows * stride_wn, 4)                          # rows start on 16 bytes
    w_ptrs = w_ptr + row_off[None, :, None] + (g[:, None, None] * 4 + q[None, None, :])
    s_ptrs = s_ptr + rows[None, :] * stride_sn + g[:, None]
    if A_WORDS:                                                            # 4 activation words a code word
        a_off = g[:, None, None] * 16 + 4 * q[None, None, :]
    else:
        a_off = g[:, None, None] * 32 + 8 * q[None, None, :]
    m_idx = tl.arange(0, BLOCK_M)
    groups = K // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g0 in range(0, groups, G):
        live = (g + g0) < groups
        w = tl.load(w_ptrs + g0 * 4, mask=live[:, None, None] & mask_n[None, :, None], other=0)
        scale = fp4_scale(tl.load(s_ptrs + g0, mask=live[:, None] & mask_n[None, :], other=127))
        v0, v1, v2, v3, v4, v5, v6, v7 = fp4_word(w, ASM)
        for m in range(count):
            a_row = (tl.load(ids_ptr + m) // rows_per_a).to(tl.int64)
            a0, a1, a2, a3, a4, a5, a6, a7 = fp4_acts(a_ptr + a_row * stride_am + a_off, g0, live[:, None, None],
                                                      A_WORDS)
            part = v0 * a0 + v1 * a1 + v2 * a2 + v3 * a3 + v4 * a4 + v5 * a5 + v6 * a6 + v7 * a7
            got = tl.sum(tl.sum(part, 2) * scale, 0)
            acc = tl.where(m_idx[:, None] == m, acc + got[None, :], acc)
    return acc


@triton.jit
def _moe_rows_kernel(a_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, sorted_ids_ptr, experts_ptr, valid_ptr, weights_ptr,
                     N, K, num_pairs, rows_per_a, alpha, limit,
                     stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr,
                     OAI: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_WEIGHTS: tl.constexpr, A_WORDS: tl.constexpr,
                     ASM: tl.constexpr, USE_PDL: tl.constexpr):
    """out[pair, n] for the pairs of one aligned block (one expert) and BLOCK_N columns: the
    arguments and epilogues of `_moe_gemm_kernel` (gate rows then up rows N below them, SWIGLU;
    routing weights, MUL_WEIGHTS)."""
    if USE_PDL:                                 # launched while the routing drains: wait for its layout
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(valid_ptr):
        return
    expert = tl.load(experts_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair_ids = tl.load(sorted_ids_ptr + offs_m)
    live_m = pair_ids < num_pairs                # an expert's run is padded at its end with the sentinel
    count = tl.sum(live_m.to(tl.int32))
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    ids_ptr = sorted_ids_ptr + pid_m * BLOCK_M
    acc = _rows_dot(a_ptr, w_base, s_base, ids_ptr, count, rows, mask_n, rows_per_a, K, stride_am, stride_wn,
                    stride_sn, BLOCK_M, BLOCK_N, BLOCK_K, A_WORDS, ASM)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        up = _rows_dot(a_ptr, w_base, s_base, ids_ptr, count, rows + N, mask_n, rows_per_a, K, stride_am, stride_wn,
                       stride_sn, BLOCK_M, BLOCK_N, BLOCK_K, A_WORDS, ASM)
        if HAS_BIAS:
            up += tl.load(bias_ptr + expert * stride_be + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc = swiglu(acc, up, alpha, limit, OAI)
    if MUL_WEIGHTS:
        acc = acc * tl.load(weights_ptr + pair_ids, mask=live_m, other=0.0)[:, None]
    out_ptrs = out_ptr + pair_ids.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=live_m[:, None] & mask_n[None, :])


def launch_rows(a: torch.Tensor, weight_args: tuple, bias: torch.Tensor | None, out: torch.Tensor,
                alignment: tuple, weights: torch.Tensor, n: int, k: int, num_pairs: int, rows_per_a: int, *,
                swiglu: bool, oai: bool, mul_weights: bool, alpha: float, limit: float) -> None:
    """One GEMM of `fused_moe` as row GEMVs over `align`'s layout at ROWS_BLOCK_M. `weight_args`:
    kernels/moe.py `_weight_args` of an MXFP4 projection; `weights`: the flat routing weights."""
    sorted_ids, experts, valid = alignment
    w, s, swe, swn, sse, ssn, fmt = weight_args
    assert fmt == "mxfp4", fmt
    block_n, block_k, warps = ROWS_TILE
    w, swe, swn = w.view(torch.int32), swe // 4, swn // 4      # 8 codes a word; K % 32 == 0
    a_arg, stride_am = a, a.stride(0)
    a_words = a.dtype == torch.bfloat16 and a.stride(1) == 1 and a.stride(0) % 2 == 0 and a.storage_offset() % 2 == 0
    if a_words:                                                # bf16 rows as int32 words of two values
        a_arg, stride_am = a.view(torch.int32), a.stride(0) // 2
    bias_t = bias.contiguous() if bias is not None else a
    grid = (sorted_ids.numel() // ROWS_BLOCK_M, triton.cdiv(n, block_n))
    pdl = MOE_PDL and use_pdl(a)
    _moe_rows_kernel[grid](a_arg, w, s, bias_t, out, sorted_ids, experts, valid, weights, n, k, num_pairs, rows_per_a,
                           alpha, limit, stride_am, swe, swn, sse, ssn, bias_t.stride(0), out.stride(0),
                           BLOCK_M=ROWS_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, SWIGLU=swiglu, OAI=oai,
                           HAS_BIAS=bias is not None, MUL_WEIGHTS=mul_weights, A_WORDS=a_words,
                           ASM=DECODE_ASM and not _interpreting(), USE_PDL=pdl, num_warps=warps, num_stages=1,
                           launch_pdl=pdl)
