"""The MoE down GEMV with the sum over the top-k folded in: one program per (token, row block).

In: the gate-up GEMV's activations [T * k, I] (pair p = token * k + slot), the down weights
(MXFP4, fp8 or 16-bit, as kernels/moe.py `_weight_args` gives them), the token's k expert ids and
routing weights (or the router logits, routed in the program as the gate-up GEMV does). Out:
y [T, H] in the activations' dtype, y[t] = sum_s w_s * (W_{e_s} act[t k + s] + b_{e_s}).

The per-pair down GEMV (kernels/moe_gemv.py) writes k fp32 rows a token and `topk_sum` adds them
in a third launch: at batch 1 that launch and its round trip are a few of the ~20 us a MoE layer
spends outside its weight bytes (BENCHMARKS.md, round 7). Here a program streams the BLOCK_N
rows of all k selected experts itself, the slots side by side in one tile (MXFP4: a [k x groups,
BLOCK_N, 4 words] tile, each group's activations and scale for its own slot; 16-bit and fp8: a
[k, BLOCK_N, BLOCK_K] tile through `rows_dot`), applies the routing weights to the per-slot sums
and writes the row once: no atomics, the same order every run. Slots of another rank's experts
are masked off (their weight is 0).

PDL: the expert ids (logits, or route_align's ids) were written two launches back and the
predecessor (the gate-up GEMV) passes its own griddepcontrol.wait before it lets this kernel
launch, so with EARLY_DOWN a program routes (reading those through L2, `.cg`) and issues its first
weight tile before it waits; only the activations need the wait. That overlaps the down's first
loads with the gate-up's tail.
"""

from __future__ import annotations

import torch

from ._triton import _interpreting, next_power_of_2, tl, triton, use_pdl
from . import moe_gemv
from .moe_gemv import FORMATS, fp4_group_dot
from .moe_gemv_dense import rows_dot
from .moe_topk import route_rows

# format -> whether decode batches on the GEMV path run this kernel (else per-pair GEMVs + `topk_sum`).
# Off until the device sweep (bench/moe_r8.sh) has measured it: round 8 built and tested it in
# Triton's interpreter only, and the session's device time ran out before a GPU ran it.
FOLD_DOWN = {"mxfp4": False, "fp8": False, "float": False}
# format -> (BLOCK_N, tile size, num_warps). mxfp4: the tile's groups of 32 (k slots x groups a
# slot), 32: [32, 16 rows, 4 words] = 8 KB a step over 8 warps, 8 words a thread, 73-80 registers in
# ptxas for sm_90 (gpt-oss at T = 1: 180 programs, 3 an SM fit). The activation tile [groups, 1, 4]
# must hold fewer values than the program has threads: Triton then lays its loads out as the code
# words' tile; at 128 values over 128 threads it kept them apart and converted every decoded value
# through shared memory each step (21 barriers a step). 16-bit / fp8: the tile's values
# (k x BLOCK_N x BLOCK_K), 4096: 32 fp32 accumulators a thread at 4 warps (8192 took 177 registers)
DOWN_TILES = {"mxfp4": (16, 32, 8), "float": (4, 4096, 4), "fp8": (4, 4096, 4)}
# route and issue the first weight tile before griddepcontrol.wait (the module docstring says why);
# off until a GPU run has checked it (bench/moe_r8.sh times both)
EARLY_DOWN = False


@triton.jit
def _slots(ids_ptr, weights_ptr, token, num_experts, E, first, stride_lt, TOP_K: tl.constexpr, E_PAD: tl.constexpr,
           K_PAD: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr, ROUTE: tl.constexpr,
           CACHE: tl.constexpr):
    """(local expert [K_PAD] int64, routing weight [K_PAD] fp32, live [K_PAD]) of a token's slots;
    dead slots (past k, another rank's expert) have expert 0 and weight 0."""
    kk = tl.arange(0, K_PAD)
    if ROUTE:
        w, sel, _ = route_rows(ids_ptr, token + tl.arange(0, 1), token + 1, E, stride_lt, TOP_K, E_PAD, K_PAD,
                               SOFTMAX_FIRST, RENORMALIZE, CACHE)
        expert = tl.sum(sel, 0).to(tl.int64) - first                   # [1, K_PAD] -> [K_PAD]
        weight = tl.sum(w, 0)
    else:
        expert = tl.load(ids_ptr + token * TOP_K + kk, mask=kk < TOP_K, other=num_experts, cache_modifier=CACHE)
        weight = tl.load(weights_ptr + token * TOP_K + kk, mask=kk < TOP_K, other=0.0, cache_modifier=CACHE)
        expert = expert.to(tl.int64)
    live = (kk < TOP_K) & (expert >= 0) & (expert < num_experts)
    return tl.where(live, expert, 0), tl.where(live, weight, 0.0), live


@triton.jit
def _mxfp4_slots_dot(a_ptr, w_ptr, s_ptr, a_row0, stride_am, w_off, s_off, gmul, live_g, rows, mask_n, K, stride_wn,
                     stride_sn,
                     GS: tl.constexpr, GG: tl.constexpr, BLOCK_N: tl.constexpr, A_WORDS: tl.constexpr,
                     ASM: tl.constexpr, WAIT: tl.constexpr):
    """sum over the tile's GG group rows of gmul[r] * (activation row a_row0 + r // GS . W rows at
    w_off[r] + rows) for MXFP4 rows, fp32 [BLOCK_N]. Group row r covers its slot's groups r % GS +
    GS j, j = 0, 1, ... The activation pointers come from scalars and aranges only, so Triton lays
    their loads out as the code words' tile (a vector of row offsets would leave them in another
    layout and convert every decoded value through shared memory each step).
    (kernels/moe_gemv.py `_mxfp4_dot` is the one-slot form: the same words, decode and scales;
    offsets in int32 words for the codes and the word-packed activations, in bytes for the scales)."""
    gg = tl.arange(0, GG)
    g = gg % GS
    q = tl.arange(0, 4)
    base = tl.multiple_of(w_off[:, None] + rows[None, :] * stride_wn, [4, 4])       # rows start on 16 bytes
    w_ptrs = w_ptr + base[:, :, None] + (g[:, None, None] * 4 + q[None, None, :])
    s_ptrs = s_ptr + s_off[:, None] + rows[None, :] * stride_sn + g[:, None]
    a_rows = a_ptr + (a_row0 + gg // GS) * stride_am
    if A_WORDS:                                                            # 4 activation words a code word
        a_ptrs = a_rows[:, None, None] + (g[:, None, None] * 16 + 4 * q[None, None, :])
    else:
        a_ptrs = a_rows[:, None, None] + (g[:, None, None] * 32 + 8 * q[None, None, :])
    groups = K // 32
    # the slot masks in the tiles' layouts once: a mask carried through the loop from `live_g` (a
    # reduction's layout) costs a shared-memory layout conversion every step; `g` is an arange
    w_live = live_g[:, None, None] & mask_n[None, :, None]
    s_live = live_g[:, None] & mask_n[None, :]
    a_live = live_g[:, None, None]
    w_next = tl.load(w_ptrs, mask=w_live & (g < groups)[:, None, None], other=0)
    s_next = tl.load(s_ptrs, mask=s_live & (g < groups)[:, None], other=127)
    if WAIT:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((GG, BLOCK_N), dtype=tl.float32)
    for g0 in range(0, groups, GS):
        w, s = w_next, s_next
        a_mask = a_live & (g + g0 < groups)[:, None, None]
        ahead = g + g0 + GS < groups
        w_next = tl.load(w_ptrs + (g0 + GS) * 4, mask=w_live & ahead[:, None, None], other=0)
        s_next = tl.load(s_ptrs + g0 + GS, mask=s_live & ahead[:, None], other=127)
        acc += fp4_group_dot(w, s, a_ptrs, g0, a_mask, A_WORDS, ASM)
    return tl.sum(acc * gmul[:, None], 0)


@triton.jit
def _down_sum_kernel(a_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, ids_ptr, weights_ptr,
                     N, K, num_experts, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
                     E, first, stride_lt,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr,
                     A_WORDS: tl.constexpr, ASM: tl.constexpr, WAIT_FIRST: tl.constexpr, WAIT_LATE: tl.constexpr,
                     CACHE: tl.constexpr, ROUTE: tl.constexpr, TOP_K: tl.constexpr, E_PAD: tl.constexpr,
                     K_PAD: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr):
    """out[t, n] = sum_s w_s (act[t TOP_K + s] . W[e_s, n] (+ b[e_s, n])). BLOCK_K: MXFP4, the
    groups of 32 a slot takes a step; else the values a slot row takes a step. WAIT_FIRST: wait
    before anything (PDL without EARLY_DOWN); WAIT_LATE: after the routing and the first weights."""
    if WAIT_FIRST:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    expert, weight, live = _slots(ids_ptr, weights_ptr, token, num_experts, E, first, stride_lt, TOP_K, E_PAD,
                                  K_PAD, SOFTMAX_FIRST, RENORMALIZE, ROUTE, CACHE)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    kk = tl.arange(0, K_PAD)
    if FORMAT == 1:
        GG: tl.constexpr = K_PAD * BLOCK_K
        slot = tl.arange(0, GG) // BLOCK_K
        onehot = slot[:, None] == kk[None, :]                            # [GG, K_PAD]: group row -> its slot
        e_g = tl.sum(tl.where(onehot, expert[None, :], 0), 1)
        w_g = tl.sum(tl.where(onehot, weight[None, :], 0.0), 1)
        live_g = tl.sum(tl.where(onehot & live[None, :], 1, 0), 1) > 0
        y = _mxfp4_slots_dot(a_ptr, w_ptr, s_ptr, token * TOP_K, stride_am, e_g * stride_we,
                             e_g * stride_se, w_g, live_g, rows, mask_n, K, stride_wn, stride_sn,
                             BLOCK_K, GG, BLOCK_N, A_WORDS, ASM, WAIT_LATE)
    else:
        part = rows_dot(a_ptr, w_ptr, (token * TOP_K + kk) * stride_am, expert * stride_we, live, rows, mask_n, K,
                        stride_wn, K_PAD, BLOCK_N, BLOCK_K, WAIT_LATE)  # [K_PAD, BLOCK_N]
        if FORMAT == 2:                                                  # e4m3 codes: each row's scale
            part *= tl.load(s_ptr + expert[:, None] * stride_se + rows[None, :] * stride_sn,
                            mask=live[:, None] & mask_n[None, :], other=0.0)
        y = tl.sum(part * weight[:, None], 0)
    if HAS_BIAS:
        b = tl.load(bias_ptr + expert[:, None] * stride_be + rows[None, :], mask=live[:, None] & mask_n[None, :],
                    other=0.0)
        y += tl.sum(b.to(tl.float32) * weight[:, None], 0)
    tl.store(out_ptr + token * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=mask_n)


def down_block(fmt: str, hidden: int, inter: int, top_k: int, tile=None) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the launch: DOWN_TILES' (or `tile`'s) tile size split over
    the k slots; BLOCK_K is groups of 32 a slot for MXFP4, values a slot otherwise."""
    block_n, size, warps = tile or DOWN_TILES[fmt]
    k_pad = next_power_of_2(top_k)
    if fmt == "mxfp4":
        return block_n, max(1, min(size // k_pad, next_power_of_2(inter // 32))), warps
    return block_n, max(16, min(size // (k_pad * block_n), next_power_of_2(inter))), warps


def launch_down_sum(act: torch.Tensor, weight_args: tuple, bias: torch.Tensor | None, out: torch.Tensor,
                    ids: torch.Tensor, weights: torch.Tensor | None, hidden: int, top_k: int, route=None,
                    tile=None) -> None:
    """out [T, hidden] = the token's k down rows, weighted and summed. act [T * k, I] from the
    gate-up GEMV; `ids`/`weights`: flat local ids [T * k] int64 and fp32 routing weights, or (route
    = (top_k, order, renormalize, first)) the router logits [T, E] in `ids`."""
    w, s, swe, swn, sse, ssn, fmt = weight_args
    inter = act.shape[1]
    block_n, block_k, warps = down_block(fmt, hidden, inter, top_k, tile)
    a_arg, stride_am, a_words = act, act.stride(0), False
    if fmt == "mxfp4":
        w, swe, swn = w.view(torch.int32), swe // 4, swn // 4      # 8 codes a word; I % 32 == 0
        a_words = act.dtype == torch.bfloat16 and act.stride(1) == 1 and act.stride(0) % 2 == 0
        if a_words:
            a_arg, stride_am = act.view(torch.int32), act.stride(0) // 2
    bias_t = bias.contiguous() if bias is not None else act
    _, order, renormalize, first = route or (top_k, "softmax_topk", False, 0)
    num_logits = ids.shape[1] if route else 1
    pdl = moe_gemv.MOE_PDL and use_pdl(act)
    early = pdl and EARLY_DOWN
    tokens = out.shape[0]
    _down_sum_kernel[(tokens, triton.cdiv(hidden, block_n))](
        a_arg, w, s, bias_t, out, ids, weights if weights is not None else ids, hidden, inter, w.shape[0],
        stride_am, swe, swn, sse, ssn, bias_t.stride(0), out.stride(0), num_logits, first,
        ids.stride(0) if route else 0,
        BLOCK_N=block_n, BLOCK_K=block_k, FORMAT=FORMATS[fmt], HAS_BIAS=bias is not None, A_WORDS=a_words,
        ASM=moe_gemv.DECODE_ASM and not _interpreting(), WAIT_FIRST=pdl and not early, WAIT_LATE=early,
        CACHE=".cg" if early else "", ROUTE=route is not None, TOP_K=top_k, E_PAD=next_power_of_2(num_logits),
        K_PAD=next_power_of_2(top_k), SOFTMAX_FIRST=order == "softmax_topk", RENORMALIZE=renormalize,
        num_warps=warps, num_stages=1, launch_pdl=pdl)
