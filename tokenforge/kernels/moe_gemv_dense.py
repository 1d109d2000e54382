"""The gate-up GEMV of 16-bit and fp8 experts at decode: one program per (token, slot) pair and
column tile, gate and up rows in one tile, SwiGLU in the epilogue.

The grouped GEMMs of kernels/moe.py pad each decode pair to a BLOCK_M tile of `tl.dot`; at batch
1 the pairs never share an expert, so that buys nothing, and Qwen3-MoE's 128 experts of 768 rows
leave the grouped launch a thin grid (43% of the read rate at T = 1, BENCHMARKS.md round 4). Here
a program reads its pair's expert id (or routes its token from the router logits, ROUTE, as the
MXFP4 GEMV does: kernels/moe_topk.py), then streams the expert's gate and up rows as one
[2, BLOCK_N, BLOCK_K] tile (`rows_dot`: 16-byte loads along K, the next step's tile issued before
this step's multiply-adds, since Triton does not pipeline loads that feed no `tl.dot`) and writes
silu(gate) * up (or gpt-oss's clamped form) for the down GEMV, which folds the sum over k
(kernels/moe_down.py). fp8 experts (e4m3 codes, an fp32 scale per row) are widened in registers
and their row scales applied to the sums. `rows_dot` is shared with the folded down GEMV, whose
first dimension is the token's k slots instead of (gate, up).
"""

from __future__ import annotations

import torch

from ._triton import next_power_of_2, tl, triton, use_pdl
from . import moe_gemv
from .moe_gemv import swiglu
from .moe_topk import route_rows

# format -> (BLOCK_N, BLOCK_K, num_warps) of the gate-up tile [2, BLOCK_N, BLOCK_K]: 4096 values a
# step (32 a thread: 96 registers for bf16 in ptxas for sm_90), a thread's activations serving its
# rows of gate and up. At batch 1 every program routes its token (a top-k over the logits), so
# fewer, longer programs route less: (8, 256) gives Qwen3-MoE 768 programs of 8 steps; (4, 512)
# (1536 of 4) avoids the two barriers a step of converting the activations' layout that (8, 256)
# has; bench/moe_gemv_sweep.py tries both
GATE_UP_TILES = {"float": (8, 256, 4), "fp8": (4, 512, 4)}
FP8_FORMAT = 2          # kernels/moe_gemv.py's FORMATS["fp8"]


@triton.jit
def rows_dot(a_ptr, w_ptr, a_off, w_off, live, rows, mask_n, K, stride_wn,
             S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WAIT: tl.constexpr):
    """[S, BLOCK_N] fp32: sum_k a[a_off[s] + k] * W[w_off[s] + rows[n] * stride_wn + k] for S
    (activation row, weight matrix) pairs at once ([S] int64 element offsets; `live` [S] masks a
    slot off, its sums 0). WAIT: this program has not passed griddepcontrol.wait yet; it waits
    after issuing the first weight tile, so those loads overlap the previous kernel's tail."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + (w_off[:, None] + rows[None, :] * stride_wn)[:, :, None] + offs_k[None, None, :]
    a_ptrs = a_ptr + a_off[:, None, None] + offs_k[None, None, :]
    w_live = live[:, None, None] & mask_n[None, :, None]
    w_next = tl.load(w_ptrs, mask=w_live & (offs_k < K)[None, None, :], other=0.0)
    if WAIT:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((S, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = w_next
        a = tl.load(a_ptrs + k0, mask=live[:, None, None] & (offs_k < K - k0)[None, None, :], other=0.0)
        w_next = tl.load(w_ptrs + k0 + BLOCK_K, mask=w_live & (offs_k < K - k0 - BLOCK_K)[None, None, :], other=0.0)
        acc += w.to(tl.float32) * a.to(tl.float32)
    return tl.sum(acc, 2)


@triton.jit
def _gate_up_kernel(a_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, ids_ptr,
                    N, K, num_experts, alpha, limit,
                    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
                    E, first, stride_lt,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OAI: tl.constexpr, HAS_BIAS: tl.constexpr,
                    FORMAT: tl.constexpr, USE_PDL: tl.constexpr, ROUTE: tl.constexpr, TOP_K: tl.constexpr,
                    E_PAD: tl.constexpr, K_PAD: tl.constexpr, SOFTMAX_FIRST: tl.constexpr,
                    RENORMALIZE: tl.constexpr):
    """out[pair, n] = swiglu(a[pair // TOP_K] . W[e, n] (+ b), a . W[e, N + n] (+ b)) with e the
    pair's expert: ids[pair] (local), or (ROUTE) slot pair % TOP_K of its token's routing from the
    logits [T, E] at `ids_ptr`, less `first`. Pairs of another rank's experts write nothing (the
    down GEMV skips them)."""
    if USE_PDL:                                 # the expert ids (or logits) come from the previous kernel
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pair = tl.program_id(0)
    if ROUTE:
        token = pair // TOP_K
        _, sel, _ = route_rows(ids_ptr, token + tl.arange(0, 1), token + 1, E, stride_lt, TOP_K, E_PAD, K_PAD,
                               SOFTMAX_FIRST, RENORMALIZE, "")
        expert = (tl.sum(tl.where(tl.arange(0, K_PAD)[None, :] == pair % TOP_K, sel, 0)) - first).to(tl.int64)
    else:
        expert = tl.load(ids_ptr + pair).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):  # another rank's expert
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    half = tl.arange(0, 2)                      # 0: the gate rows, 1: the up rows (N rows below)
    w_off = expert * stride_we + (half * N).to(tl.int64) * stride_wn
    a_off = tl.zeros((2,), dtype=tl.int64) + (pair // TOP_K).to(tl.int64) * stride_am
    acc = rows_dot(a_ptr, w_ptr, a_off, w_off, half < 2, offs_n.to(tl.int64), mask_n, K, stride_wn,
                   2, BLOCK_N, BLOCK_K, False)                          # [2, BLOCK_N]
    cols = half[:, None] * N + offs_n[None, :]
    if FORMAT == 2:                             # e4m3 codes: each row's scale, before the bias
        acc *= tl.load(s_ptr + expert * stride_se + cols * stride_sn, mask=mask_n[None, :], other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + cols, mask=mask_n[None, :], other=0.0).to(tl.float32)
    gate = tl.sum(tl.where(half[:, None] == 0, acc, 0.0), 0)
    up = tl.sum(tl.where(half[:, None] == 1, acc, 0.0), 0)
    act = swiglu(gate, up, alpha, limit, OAI)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs_n, act.to(out_ptr.dtype.element_ty), mask=mask_n)


def launch_gate_up(x: torch.Tensor, weight_args: tuple, bias: torch.Tensor | None, out: torch.Tensor,
                   ids: torch.Tensor, inter: int, top_k: int, *, oai: bool, alpha: float, limit: float,
                   tile=None, route=None) -> None:
    """act [pairs, inter] = SwiGLU of the gate-up GEMV for x [T, H] (16-bit, contiguous) and float
    or fp8 weights (kernels/moe.py `_weight_args`); `ids`: flat local ids [pairs] int64, or (route
    = (top_k, order, renormalize, first)) the router logits [T, E]. `tile`: (BLOCK_N, BLOCK_K,
    warps, stages) in place of GATE_UP_TILES' (stages unused: the loop prefetches by hand)."""
    w, s, swe, swn, sse, ssn, fmt = weight_args
    block_n, block_k, warps = (tile or GATE_UP_TILES[fmt])[:3]
    block_k = min(block_k, max(16, next_power_of_2(x.shape[1])))
    bias_t = bias.contiguous() if bias is not None else x
    _, order, renormalize, first = route or (1, "softmax_topk", False, 0)
    pairs = x.shape[0] * top_k
    num_logits = ids.shape[1] if route else 1
    pdl = moe_gemv.MOE_PDL and use_pdl(x)
    _gate_up_kernel[(pairs, triton.cdiv(inter, block_n))](
        x, w, s, bias_t, out, ids, inter, x.shape[1], w.shape[0], alpha, limit,
        x.stride(0), swe, swn, sse, ssn, bias_t.stride(0), out.stride(0), num_logits, first,
        ids.stride(0) if route else 0,
        BLOCK_N=block_n, BLOCK_K=block_k, OAI=oai, HAS_BIAS=bias is not None,
        FORMAT=FP8_FORMAT if fmt == "fp8" else 0, USE_PDL=pdl, ROUTE=route is not None, TOP_K=top_k,
        E_PAD=next_power_of_2(num_logits), K_PAD=next_power_of_2(top_k), SOFTMAX_FIRST=order == "softmax_topk",
        RENORMALIZE=renormalize, num_warps=warps, num_stages=1, launch_pdl=pdl)
