"""MXFP4 MoE GEMMs over a few rows an expert, computed transposed: the decoded weights are the
MMA's left operand, the expert's few rows its narrow right one.

A 128-token prefill of gpt-oss routes 512 pairs: 4 rows an expert on 120b (128 experts), 16 on
20b (32). The grouped GEMM of kernels/moe.py puts the rows on the left (BLOCK_M 32 of them, most
padding) and the decoded MXFP4 tile on the right, in 1-byte loads; on an H100 its two launches
took 97 of 103 ms of 120b's W1 prefill (bench/moe_prefill_profile.py, BENCHMARKS round 20). A
first version of this file, per-row GEMVs decoding each tile once and walking the rows with FMAs,
was slower still (a cross-thread sum per row a step) and was replaced. Here out^T = W a^T: a
program takes one block of `align`'s sorted pairs (ROWS_BLOCK_M rows of one expert, the MMA's N)
and BLOCK_N weight rows (its M, 64 a warpgroup); the bytes arrive in 16-byte copies (K steps
divide K, so no load is masked along it), decode in registers and interleave back into k order as
the left operand, one dot a step. Measured on an H100 against the grouped GEMMs (one MoE layer,
`bench/moe_rows_sweep.py`): 1.6-3.5x faster at T = 32-512 on both gpt-oss shapes; W1 prefill of
120b 104 -> 54 ms.

In: `fused_moe`'s arguments with `align`'s layout at block size `ROWS_BLOCK_M`. Out: the GEMM's
rows, with the epilogues of the other two paths (biases, SwiGLU or gpt-oss's clamped form,
routing weights). `rows_path` says when a batch takes it: MXFP4 experts, past the GEMV path's
pair count, while an expert averages at most `ROWS_PER_EXPERT` rows.
"""

from __future__ import annotations

import torch

from tokenforge import envs

from ._triton import tl, triton, use_pdl
from .moe_gemv import MOE_PDL, swiglu
from .mxfp4 import fp4_pair, fp4_scale

ROWS_BLOCK_M = 16          # rows of one expert a program takes, the MMA's N (align pads each expert's run to it)
# the most rows an expert averages (pairs / experts) for this path: up to 64 (gpt-oss-20b at T = 512)
# it beat the grouped GEMMs 2.2x on an H100 (bench/moe_rows_sweep.py, BENCHMARKS round 20); past it, unmeasured
ROWS_PER_EXPERT = 64
# BLOCK_N (the MMA's M: 64 a warpgroup), BLOCK_K (the launch halves it until it divides K: 64 for
# gpt-oss's 2880), warps, stages: 2 stages the best or within 1% of it in 5 of the sweep's 6 (shape, T)
# cases on an H100 (120b at T = 32: 16% behind 3-4 stages), 64-row tiles ahead of 128 in all
ROWS_TILE = (64, 128, 4, 2)
ENABLED = envs.moe_rows()


def rows_path(fmt: str, pairs: int, num_experts: int) -> bool:
    return ENABLED and fmt == "mxfp4" and pairs <= ROWS_PER_EXPERT * num_experts


@triton.jit
def _rows_mma(a_ptr, w_ptr, s_ptr, a_row, mask_m, rows, mask_n, K, stride_am, stride_wn, stride_sn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """[BLOCK_N, BLOCK_M] fp32: the MXFP4 rows at `rows` times the activation rows `a_row`, W on the
    left. K is a multiple of BLOCK_K (the launch picks it), so no load is masked along K: a weight
    row's bytes load as [groups, 16] runs of 16 bytes, each group's scale once; the nibbles decode
    by a few integer ops (`fp4_pair`), scale, and interleave back into k order (even k the low
    nibble) as one [BLOCK_N, BLOCK_K] left operand; the activations load as [BLOCK_K, BLOCK_M]."""
    G: tl.constexpr = BLOCK_K // 32
    g = tl.arange(0, G)
    b = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None, None] * stride_wn + (g[None, :, None] * 16 + b[None, None, :])
    s_ptrs = s_ptr + rows[:, None] * stride_sn + g[None, :]
    a_ptrs = a_ptr + a_row[None, :] * stride_am + offs_k[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        scale = fp4_scale(tl.load(s_ptrs + k0 // 32, mask=mask_n[:, None], other=127))[:, :, None]
        lo, hi = fp4_pair(tl.load(w_ptrs + k0 // 2, mask=mask_n[:, None, None], other=0))
        a = tl.load(a_ptrs + k0, mask=mask_m[None, :], other=0.0)
        w = tl.join((lo * scale).to(a.dtype), (hi * scale).to(a.dtype)).reshape(BLOCK_N, BLOCK_K)
        acc += tl.dot(w, a, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _moe_rows_kernel(a_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, sorted_ids_ptr, experts_ptr, valid_ptr, weights_ptr,
                     N, K, num_pairs, rows_per_a, alpha, limit,
                     stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr,
                     OAI: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_WEIGHTS: tl.constexpr, USE_PDL: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """out[pair, n] for the pairs of one aligned block (one expert) and BLOCK_N columns: the
    arguments and epilogues of `_moe_gemm_kernel` (gate rows then up rows N below them, SWIGLU;
    routing weights, MUL_WEIGHTS), computed transposed ([columns, pairs])."""
    if USE_PDL:                                 # launched while the routing drains: wait for its layout
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(valid_ptr):
        return
    expert = tl.load(experts_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pair < num_pairs                   # an expert's run is padded at its end with the sentinel
    a_row = (pair // rows_per_a).to(tl.int64)   # the token (gate-up) or the pair itself (down)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    acc = _rows_mma(a_ptr, w_base, s_base, a_row, mask_m, rows, mask_n, K, stride_am, stride_wn, stride_sn,
                    BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    if SWIGLU:
        up = _rows_mma(a_ptr, w_base, s_base, a_row, mask_m, rows + N, mask_n, K, stride_am, stride_wn, stride_sn,
                       BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
        if HAS_BIAS:
            up += tl.load(bias_ptr + expert * stride_be + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        acc = swiglu(acc, up, alpha, limit, OAI)
    if MUL_WEIGHTS:
        acc = acc * tl.load(weights_ptr + pair, mask=mask_m, other=0.0)[None, :]
    out_ptrs = out_ptr + pair.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


def launch_rows(a: torch.Tensor, weight_args: tuple, bias: torch.Tensor | None, out: torch.Tensor,
                alignment: tuple, weights: torch.Tensor, n: int, k: int, num_pairs: int, rows_per_a: int, *,
                swiglu: bool, oai: bool, mul_weights: bool, alpha: float, limit: float) -> None:
    """One GEMM of `fused_moe` through the row path, over `align`'s layout at ROWS_BLOCK_M. `weight_args`:
    kernels/moe.py `_weight_args` of an MXFP4 projection; `weights`: the flat routing weights."""
    sorted_ids, experts, valid = alignment
    w, s, swe, swn, sse, ssn, fmt = weight_args
    assert fmt == "mxfp4", fmt
    block_n, block_k, warps, stages = ROWS_TILE
    block_k = next(b for b in (block_k, 64, 32) if k % b == 0)    # MXFP4 rows are whole groups of 32
    bias_t = bias.contiguous() if bias is not None else a
    grid = (sorted_ids.numel() // ROWS_BLOCK_M, triton.cdiv(n, block_n))
    pdl = MOE_PDL and use_pdl(a)
    _moe_rows_kernel[grid](a, w, s, bias_t, out, sorted_ids, experts, valid, weights, n, k, num_pairs, rows_per_a,
                           alpha, limit, a.stride(0), swe, swn, sse, ssn, bias_t.stride(0), out.stride(0),
                           BLOCK_M=ROWS_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, SWIGLU=swiglu, OAI=oai,
                           HAS_BIAS=bias is not None, MUL_WEIGHTS=mul_weights, USE_PDL=pdl,
                           DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
                           num_warps=warps, num_stages=stages, launch_pdl=pdl)
