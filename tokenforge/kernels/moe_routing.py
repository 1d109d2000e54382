"""Routing and alignment of a decode-sized MoE batch in one Triton launch.

`route` + `align` (kernels/moe.py) are about twenty small torch kernels (softmax, top-k, the
renormalisation, a scatter count, cumsums, a sort, a search); at decode each costs a few
microseconds of launch, more than the expert GEMMs of a small model. `route_align` does the same
work in one program: router logits [T, E] -> routing weights [T, k] fp32, this rank's expert ids
[T, k] (another rank's experts -> the sentinel E_local, as `_rank_local_ids` maps them), and the
sorted-and-padded pair layout that `fused_moe` takes (`alignment=`), equal to `align`'s: pairs
sorted by expert, in pair order within an expert, each expert's run padded to BLOCK_M with the
sentinel T*k, the expert of each block (-1 past the valid length), and the valid length.

One program holds the batch in registers, so it runs while T*k and E stay small (a [pairs,
experts] and a [pairs, pairs] tile of at most MAX_TILE elements) and T <= MAX_TOKENS: decode up to
16 sequences on every shipped MoE. Larger batches (prefills, big decode steps) take the same
outputs from three launches (kernels/moe_route_wide.py); past those limits `route_align` returns
None and the caller takes the torch `route` + `align`.
"""

from __future__ import annotations

import torch

from ._triton import next_power_of_2, require_triton, tl, triton, use_pdl
from .moe import ROUTING_ORDERS, _weight_args, alignment_block, fused_moe, padded_length, weight_format
from .moe_decode import gemv_moe
from .moe_gemv import gemv_pairs
from .moe_route_wide import route_align_wide, wide_fits
from .moe_rows import ROWS_BLOCK_M, rows_path
from .moe_topk import route_and_store

MAX_TILE = 16384
MAX_TOKENS = 16       # the decode CUDA-graph buckets 1, 2, 4, 8, 16 compile every variant at start-up
# batches up to this many tokens route inside the GEMVs (`_routed_gemv`); larger GEMV batches take
# route_align first: on the H200 routed 42.0 vs 46.1 us at T = 1 (gpt-oss-20b), 45.6 vs 46.5 (120b),
# but 119.5 vs 116.3 at T = 4 and 399.6 vs 380.1 at T = 16, where every program re-routing its
# token costs more than the launch it saves (BENCHMARKS.md, round 7b)
ROUTED_GEMV_TOKENS = 1
# ... and at most this many experts: each gate-up program routes its token after griddepcontrol.wait,
# so the top-k's cross-warp reductions over 128 logits (k of them) sit on the step's critical path
# (gpt-oss-120b, 128 experts: routed 45.6 vs 46.5 us, a 0.9 us gain against 4.1 at 32 experts);
# bench/moe_gemv_sweep.py's "gemv-route-align" row measures it for Qwen3-MoE's k = 8 of 128
ROUTED_GEMV_EXPERTS = 128


@triton.jit
def _route_align_kernel(logits_ptr, weights_ptr, ids_ptr, sorted_ids_ptr, experts_ptr, valid_ptr,
                        T, E, first, num_local, cap, stride_lt,
                        K: tl.constexpr, T_PAD: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                        P_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BLOCKS_CHUNK: tl.constexpr,
                        SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:                           # launched while the router's GEMV drains: wait for its logits
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    cols = tl.arange(0, E_PAD)
    route_and_store(logits_ptr, weights_ptr, ids_ptr, tl.arange(0, T_PAD), T, E, first, num_local, stride_lt, K,
                    E_PAD, K_PAD, SOFTMAX_FIRST, RENORMALIZE)

    pairs = T * K
    for c in range(0, cap, CHUNK):        # every slot starts as padding
        o = c + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + o, tl.zeros((CHUNK,), dtype=tl.int32) + pairs, mask=o < cap)
    tl.debug_barrier()                    # the ids above and the padding, visible to every thread
    p = tl.arange(0, P_PAD)
    expert = tl.load(ids_ptr + p, mask=p < pairs, other=E_PAD).to(tl.int32)       # pair p's expert
    onehot = (expert[:, None] == cols[None, :]) & (cols[None, :] < num_local)     # [P_PAD, E_PAD]
    padded = (tl.sum(onehot.to(tl.int32), 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    start_of = tl.sum(tl.where(onehot, starts[None, :], 0), 1)
    same_before = (expert[None, :] == expert[:, None]) & (p[None, :] < p[:, None])  # [P_PAD (p), P_PAD (q)]
    rank = tl.sum(same_before.to(tl.int32), 1)
    tl.store(sorted_ids_ptr + start_of + rank, p, mask=(p < pairs) & (expert < num_local))
    total = tl.sum(padded, 0)
    tl.store(valid_ptr, total)
    num_blocks = cap // BLOCK_M
    for c in range(0, num_blocks, BLOCKS_CHUNK):    # [BLOCKS_CHUNK, E_PAD] compares a pass
        b = c + tl.arange(0, BLOCKS_CHUNK)
        begin = b * BLOCK_M
        owner = tl.sum(((ends[None, :] <= begin[:, None]) & (cols[None, :] < num_local)).to(tl.int32), 1)
        tl.store(experts_ptr + b, tl.where(begin < total, owner, -1), mask=b < num_blocks)


def _pads(tokens: int, num_experts: int, top_k: int) -> tuple[int, int, int, int]:
    """(T_PAD, E_PAD, K_PAD, P_PAD): P_PAD = T_PAD * K_PAD, so the variants compiled depend on the
    token count's power of two alone (the CUDA-graph buckets' at start-up)."""
    t_pad, k_pad = next_power_of_2(max(1, tokens)), next_power_of_2(top_k)
    return t_pad, next_power_of_2(num_experts), k_pad, t_pad * k_pad


def fits(tokens: int, num_experts: int, top_k: int) -> bool:
    """Whether `route_align` takes a batch of this size (else the torch route + align)."""
    t_pad, e_pad, _, p_pad = _pads(tokens, num_experts, top_k)
    return 0 < tokens <= MAX_TOKENS and max(p_pad * e_pad, p_pad * p_pad, t_pad * e_pad) <= MAX_TILE


def route_align(logits: torch.Tensor, top_k: int, order: str, renormalize: bool, block_m: int,
                first: int = 0, num_local: int | None = None):
    """(weights [T, k] fp32, local ids [T, k] int64, sorted pair ids, expert per block, valid [1])
    for router logits [T, E]: in one launch for a batch that `fits`, in three for one that
    `wide_fits`, else None. `first`/`num_local`: this rank's experts under expert parallelism
    (default: all of them)."""
    if order not in ROUTING_ORDERS:
        raise ValueError(f"unknown routing order {order!r}; supported: {', '.join(ROUTING_ORDERS)}")
    tokens, num_experts = logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({num_experts})")
    num_local = num_experts if num_local is None else num_local
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    if not fits(tokens, num_experts, top_k):
        if not wide_fits(tokens, num_experts, top_k):
            return None
        return route_align_wide(logits, top_k, order == "softmax_topk", renormalize, block_m, first, num_local)
    require_triton(logits)
    pairs, device = tokens * top_k, logits.device
    cap = padded_length(pairs, num_local, block_m)                               # as `align` sizes it
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=device)
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=device)
    experts = torch.empty(cap // block_m, dtype=torch.int32, device=device)
    valid = torch.empty(1, dtype=torch.int32, device=device)
    t_pad, e_pad, k_pad, p_pad = _pads(tokens, num_experts, top_k)
    _route_align_kernel[(1,)](
        logits, weights, ids, sorted_ids, experts, valid, tokens, num_experts, first, num_local, cap,
        logits.stride(0), K=top_k, T_PAD=t_pad, E_PAD=e_pad, K_PAD=k_pad, P_PAD=p_pad, BLOCK_M=block_m, CHUNK=256,
        BLOCKS_CHUNK=max(1, min(64, MAX_TILE // e_pad)),
        SOFTMAX_FIRST=order == "softmax_topk", RENORMALIZE=renormalize, USE_PDL=use_pdl(logits),
        num_warps=8, launch_pdl=use_pdl(logits))
    return weights, ids, sorted_ids, experts, valid


def fused_moe_from_logits(x: torch.Tensor, logits: torch.Tensor, w13, w2, top_k: int, order: str,
                          renormalize: bool, first: int = 0, num_local: int | None = None, **kwargs):
    """`fused_moe` from the router's logits, routed and aligned by `route_align` (one launch at
    decode, three for larger batches): [T, H], or None when the batch fits neither (the caller
    routes with torch). kwargs go to `fused_moe`.
    A batch of at most ROUTED_GEMV_TOKENS (and ROUTED_GEMV_EXPERTS) that takes the GEMVs (`gemv_pairs`, or
    `gemv=True`) needs no alignment: each GEMV program routes its own token (`_routed_gemv`), so
    no routing launch precedes them."""
    pairs = x.shape[0] * top_k
    gemv = kwargs.get("gemv")
    fmt = weight_format(w13)
    limit = gemv_pairs(fmt, x.shape[1], w2.shape[2], w13.shape[0]) if gemv is None else 0
    routed = x.shape[0] <= ROUTED_GEMV_TOKENS and logits.shape[1] <= ROUTED_GEMV_EXPERTS
    if routed and (gemv or (gemv is None and pairs <= limit)):
        if order not in ROUTING_ORDERS:
            raise ValueError(f"unknown routing order {order!r}; supported: {', '.join(ROUTING_ORDERS)}")
        if not 1 <= top_k <= logits.shape[1]:
            raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({logits.shape[1]})")
        require_triton(x, logits)
        return _routed_gemv(x, logits, w13, w2, top_k, order, renormalize, first, **kwargs)
    block = ROWS_BLOCK_M if rows_path(fmt, pairs, w13.shape[0]) else alignment_block(pairs, x.element_size())
    plan = route_align(logits, top_k, order, renormalize, block, first, num_local)
    if plan is None:
        return None
    weights, ids, *alignment = plan
    return fused_moe(x, w13, w2, weights, ids, alignment=tuple(alignment), **kwargs)


def _routed_gemv(x, logits, w13, w2, top_k: int, order: str, renormalize: bool, first: int,
                 w13_bias=None, w2_bias=None, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                 all_local: bool = False, tile=None, gemv=None) -> torch.Tensor:
    """`fused_moe`'s GEMV path (kernels/moe_decode.py) with the routing done by the GEMV programs
    from the logits (ROUTE), so no routing launch precedes them."""
    x, logits = x.contiguous(), logits if logits.stride(1) == 1 else logits.contiguous()
    return gemv_moe(x, _weight_args(w13), _weight_args(w2), top_k, logits, None, w13_bias, w2_bias,
                    oai=activation == "swiglu_oai", alpha=alpha, limit=limit, all_local=all_local, tile=tile,
                    route=(top_k, order, renormalize, first))
