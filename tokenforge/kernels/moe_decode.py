"""The fused MoE's GEMV path at decode: the gate-up and the down GEMM as per-pair GEMVs
(kernels/moe_gemv.py), then `topk_sum` adds each token's k rows.

In: x [T, H], the two projections as kernels/moe.py `_weight_args` gives them, and either local
expert ids and routing weights [T, k] or (route) the router logits [T, E], which each program
routes itself. Out: [T, H] in x's dtype, this rank's partial sum of the token's k experts.
No part reads back to the host.

Round 8's down GEMV that summed the k experts itself (no `topk_sum` launch) and its 16-bit/fp8
gate-up GEMV were measured on an H100 and removed: 2x slower for MXFP4 at T = 1, no faster for
16-bit, slower for every format at T >= 8 (BENCHMARKS.md, "MoE sweep").
"""

from __future__ import annotations

import torch

from ._triton import next_power_of_2, tl, triton, use_pdl
from . import moe_gemv
from .moe_gemv import launch_gemv


def gemv_moe(x: torch.Tensor, w13_args: tuple, w2_args: tuple, top_k: int, ids: torch.Tensor,
             weights: torch.Tensor | None, w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None, *, oai: bool,
             alpha: float, limit: float, all_local: bool, tile=None, route=None) -> torch.Tensor:
    """`fused_moe` as GEMVs. `ids`/`weights`: local ids and routing weights [T, k]; or with `route`
    = (top_k, order, renormalize, first) the router logits [T, E] in `ids` (weights unused).
    `tile`: both GEMVs' (BLOCK_N, BLOCK_K, warps, stages) in place of GEMV_TILES'."""
    tokens, hidden = x.shape
    pairs, inter = tokens * top_k, w13_args[0].shape[1] // 2
    if route is None:
        ids, weights = ids.reshape(-1).contiguous(), weights.reshape(-1).float().contiguous()
    else:
        weights = ids                                   # unused: each program takes its routing weight
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    launch_gemv(x, w13_args, w13_bias, act, ids, weights, inter, hidden, top_k, swiglu=True, oai=oai,
                mul_weights=False, alpha=alpha, limit=limit, tile=tile, route=route)
    # zeros: pairs of another rank's experts are never written, and the sum over k reads them
    out = (torch.empty if all_local else torch.zeros)(pairs, hidden, dtype=torch.float32, device=x.device)
    launch_gemv(act, w2_args, w2_bias, out, ids, weights, hidden, inter, 1, swiglu=False, oai=False,
                mul_weights=True, alpha=alpha, limit=limit, tile=tile, route=route)
    return topk_sum(out.view(tokens, top_k, hidden), x.dtype)


@triton.jit
def _topk_sum_kernel(src_ptr, dst_ptr, H, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                     USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    kk = tl.arange(0, K_PAD)
    mask = (kk < K)[:, None] & (offs_h < H)[None, :]
    rows = tl.load(src_ptr + (t * K + kk)[:, None] * H + offs_h[None, :], mask=mask, other=0.0)
    tl.store(dst_ptr + t * H + offs_h, tl.sum(rows, 0).to(dst_ptr.dtype.element_ty), mask=offs_h < H)


def topk_sum(src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, k, H] fp32 -> its sum over k in `dtype`, in one launch (torch's sum and cast are two:
    some 5 us a MoE layer at decode)."""
    tokens, top_k, hidden = src.shape
    dst = torch.empty(tokens, hidden, dtype=dtype, device=src.device)
    if tokens:
        block_h = 1024
        pdl = moe_gemv.MOE_PDL and use_pdl(src)
        _topk_sum_kernel[(tokens, triton.cdiv(hidden, block_h))](src, dst, hidden, K=top_k,
                                                                  K_PAD=next_power_of_2(top_k), BLOCK_H=block_h,
                                                                  USE_PDL=pdl, launch_pdl=pdl)
    return dst
