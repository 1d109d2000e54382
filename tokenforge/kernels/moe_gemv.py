"""The fused MoE's decode GEMMs as GEMVs: one program per (token, slot) pair and column tile.

At decode a MoE layer multiplies a handful of activation rows by the experts they select. The
grouped GEMMs of kernels/moe.py sort the pairs by expert into blocks of BLOCK_M rows and run
`tl.dot` on them; for MXFP4 experts each decoded weight tile must then be laid out as an MMA
operand, which costs more than decoding it (8-19% of the read rate on the gpt-oss shapes at
T = 1-16, BENCHMARKS.md round 4). Here a program takes one pair, loads its expert's rows as
stored (MXFP4 bytes, e4m3 codes or 16-bit values), multiplies them by the pair's activation row
with plain fused multiply-adds and reduces along K in registers: no MMA layout, no padding, and no
alignment (each pair reads its expert id itself; ids >= E, another rank's experts, return at
once). MXFP4 bytes are loaded as [BLOCK_N, groups, 16] tiles, so each group's scale is loaded once
and applied to the group's sum rather than to each value.

`gemv_pairs` is the largest pair count this path takes per weight format (kernels/moe.py asks it);
past it the pairs that share an expert make the grouped GEMM's single read of each expert pay.
The layouts, epilogues (biases, SwiGLU or gpt-oss's clamped form, routing weights) and outputs are
those of `_moe_gemm_kernel`, so `fused_moe` swaps one launch for the other.
"""

from __future__ import annotations

import torch

from ._triton import tl, triton
from .mxfp4 import GROUP, fp4_pair, fp4_scale

# format -> the most (token, slot) pairs the GEMV takes: each pair reads its expert's rows itself,
# so when several pairs share an expert the grouped GEMM's one read of it wins
GEMV_PAIRS = {"mxfp4": 16, "fp8": 0, "float": 0}
# format -> (BLOCK_N, BLOCK_K, num_warps, num_stages); mxfp4: the H200 sweep's best at T = 1-4 (round 6)
GEMV_TILES = {"mxfp4": (16, 256, 4, 3), "fp8": (16, 256, 4, 3), "float": (16, 256, 4, 3)}
FORMATS = {"float": 0, "mxfp4": 1, "fp8": 2}


def gemv_pairs(fmt: str) -> int:
    return GEMV_PAIRS[fmt]


@triton.jit
def swiglu(gate, up, alpha, limit, OAI: tl.constexpr):
    """silu(gate) * up, or (OAI) gpt-oss's form: gate clamped above at `limit`, up to +-limit,
    gate * sigmoid(alpha * gate) * (up + 1). The epilogue of both MoE GEMM kernels."""
    if OAI:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return gate * tl.sigmoid(alpha * gate) * (up + 1.0)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _row_dot(a_ptr, w_ptr, s_ptr, rows, mask_n, a_row, K, stride_am, stride_wn, stride_sn,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FORMAT: tl.constexpr):
    """sum_k a[a_row, k] * W[row, k] for the BLOCK_N rows at `rows` ([BLOCK_N] int64 offsets of
    this expert's rows) as fp32 [BLOCK_N]; e4m3 codes come back unscaled (the caller's epilogue)."""
    if FORMAT == 1:                              # MXFP4: [BLOCK_N, groups, 16] bytes, a scale a group
        G: tl.constexpr = BLOCK_K // 32
        g = tl.arange(0, G)
        b = tl.arange(0, 16)
        byte_off = (g[:, None] * 16 + b[None, :])[None, :, :]                  # [1, G, 16]
        w_ptrs = w_ptr + rows[:, None, None] * stride_wn + byte_off
        s_ptrs = s_ptr + rows[:, None] * stride_sn + g[None, :]
        a_ptrs = a_ptr + a_row * stride_am + 2 * byte_off
        acc = tl.zeros((BLOCK_N, G), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            live = byte_off < (K - k0) // 2
            mask_w = mask_n[:, None, None] & live
            a_even = tl.load(a_ptrs + k0, mask=live, other=0.0).to(tl.float32)
            a_odd = tl.load(a_ptrs + k0 + 1, mask=live, other=0.0).to(tl.float32)
            lo, hi = fp4_pair(tl.load(w_ptrs + k0 // 2, mask=mask_w, other=0))
            group_sum = tl.sum(lo * a_even + hi * a_odd, 2)                    # [BLOCK_N, G]
            mask_s = mask_n[:, None] & (g[None, :] < (K - k0) // 32)
            acc += group_sum * fp4_scale(tl.load(s_ptrs + k0 // 32, mask=mask_s, other=127))
        return tl.sum(acc, 1)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
        a_ptrs = a_ptr + a_row * stride_am + offs_k
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            live = offs_k < K - k0
            a = tl.load(a_ptrs + k0, mask=live, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & live[None, :], other=0.0).to(tl.float32)
            acc += w * a[None, :]
        return tl.sum(acc, 1)


@triton.jit
def _moe_gemv_kernel(a_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, ids_ptr, weights_ptr,
                     N, K, num_experts, rows_per_a, alpha, limit,
                     stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr, OAI: tl.constexpr,
                     HAS_BIAS: tl.constexpr, FORMAT: tl.constexpr, MUL_WEIGHTS: tl.constexpr):
    """out[pair, n] = a[pair // rows_per_a] . W[ids[pair], n] (+ bias), the epilogues of
    `_moe_gemm_kernel` (same arguments, with the flat expert ids in place of the alignment)."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if expert >= num_experts:                   # another rank's expert: its row stays as it is
        return
    a_row = (pair // rows_per_a).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    acc = _row_dot(a_ptr, w_base, s_base, rows, mask_n, a_row, K, stride_am, stride_wn, stride_sn,
                   BLOCK_N, BLOCK_K, FORMAT)
    if FORMAT == 2:
        acc *= tl.load(s_base + offs_n * stride_sn, mask=mask_n, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if SWIGLU:                                  # the up rows sit N rows below the gate rows
        up = _row_dot(a_ptr, w_base, s_base, rows + N, mask_n, a_row, K, stride_am, stride_wn, stride_sn,
                      BLOCK_N, BLOCK_K, FORMAT)
        if FORMAT == 2:
            up *= tl.load(s_base + (offs_n + N) * stride_sn, mask=mask_n, other=0.0)
        if HAS_BIAS:
            up += tl.load(bias_ptr + expert * stride_be + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc = swiglu(acc, up, alpha, limit, OAI)
    if MUL_WEIGHTS:
        acc = acc * tl.load(weights_ptr + pair)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def launch_gemv(a: torch.Tensor, weight_args: tuple, bias: torch.Tensor | None, out: torch.Tensor,
                ids: torch.Tensor, weights: torch.Tensor, n: int, k: int, rows_per_a: int, *, swiglu: bool,
                oai: bool, mul_weights: bool, alpha: float, limit: float, tile=None) -> None:
    """One GEMM of `fused_moe` as GEMVs over the flat ids [pairs] (int64). `weight_args`: what
    kernels/moe.py's `_weight_args` returns for the projection; `tile`: (BLOCK_N, BLOCK_K, warps,
    stages) in place of GEMV_TILES' (the sweep of `bench kernels --part moe_tiles`)."""
    w, s, swe, swn, sse, ssn, fmt = weight_args
    block_n, block_k, warps, stages = tile or GEMV_TILES[fmt]
    if fmt == "mxfp4":
        block_k = max(GROUP, block_k)
    bias_t = bias.contiguous() if bias is not None else a
    grid = (ids.numel(), triton.cdiv(n, block_n))
    _moe_gemv_kernel[grid](a, w, s, bias_t, out, ids, weights, n, k, w.shape[0], rows_per_a, alpha, limit,
                           a.stride(0), swe, swn, sse, ssn, bias_t.stride(0), out.stride(0),
                           BLOCK_N=block_n, BLOCK_K=block_k, SWIGLU=swiglu, OAI=oai, HAS_BIAS=bias is not None,
                           FORMAT=FORMATS[fmt], MUL_WEIGHTS=mul_weights, num_warps=warps, num_stages=stages)
