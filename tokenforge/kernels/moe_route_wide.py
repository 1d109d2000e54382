"""Routing and alignment of a prefill-sized MoE batch in three Triton launches.

`route_align` (kernels/moe_routing.py) holds a whole decode batch in one program, so it stops at
16 tokens. Past that, `route` + `align` (kernels/moe.py) in torch are about twenty small kernels
a layer (softmax, top-k, a scatter count, cumsums, a stable sort, gathers, an index-put). On a
prefill each is a host launch: a Qwen3-30B-A3B 128-token prefill spent 85% of its wall time on
the host (BENCHMARKS.md, round 20's `moe-prefill`). Here the same outputs come from three:

1. `_route_blocks_kernel`, one program per block of TB tokens: the top-k routing of its rows
   (`route_and_store`, the decode path's), the routing weights and this rank's expert ids [T, k], and
   the block's count of pairs per expert [num_blocks, E_PAD].
2. `_align_offsets_kernel`, one program: the experts' counts padded to BLOCK_M and their starts,
   each block's first slot per expert (the start plus the earlier blocks' counts), the padding of
   every slot with the sentinel T*k, the expert of each BLOCK_M block and the valid length.
3. `_align_place_kernel`, one program per token block: each pair's slot, its expert's offset for
   the block plus the pairs of the same expert before it in the block.

So pairs are sorted by expert, in pair order within an expert, each expert's run padded to
BLOCK_M: `align`'s layout exactly (its stable sort), which `fused_moe` takes as `alignment=`.
Nothing reads back to the host. Each block holds TB * K_PAD = 128 pair slots (TB = 16 tokens at
k = 8, 32 at k = 4, 64 at k = 2).
"""

from __future__ import annotations

import torch

from tokenforge import envs

from ._triton import next_power_of_2, require_triton, tl, triton
from .moe import padded_length
from .moe_topk import route_and_store

PAIR_SLOTS = 128          # a token block's pair slots (TB * K_PAD): the placement's [P, P] compare
MAX_EXPERTS = 256         # the block's [TB, K_PAD, E_PAD] count tile: 128 x E_PAD elements (32K at 256)
MAX_TOKENS = 16384        # past this the torch route + align (launch costs no longer matter there)
ENABLED = envs.moe_wide_route()     # TOKENFORGE_MOE_WIDE_ROUTE=0: the torch route + align, for A/B runs


@triton.jit
def _route_blocks_kernel(logits_ptr, weights_ptr, ids_ptr, hist_ptr, T, E, first, num_local, stride_lt,
                         K: tl.constexpr, TB: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                         SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr):
    b = tl.program_id(0)
    cols = tl.arange(0, E_PAD)
    local, out = route_and_store(logits_ptr, weights_ptr, ids_ptr, b * TB + tl.arange(0, TB), T, E, first, num_local,
                                 stride_lt, K, E_PAD, K_PAD, SOFTMAX_FIRST, RENORMALIZE)
    hits = (local[:, :, None] == cols[None, None, :]) & out[:, :, None]          # [TB, K_PAD, E_PAD]
    tl.store(hist_ptr + b * E_PAD + cols, tl.sum(tl.sum(hits.to(tl.int32), 0), 0))


@triton.jit
def _align_offsets_kernel(hist_ptr, offsets_ptr, sorted_ids_ptr, experts_ptr, valid_ptr, num_blocks, num_local,
                          cap, pairs, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, NB: tl.constexpr,
                          CHUNK: tl.constexpr, BLOCKS_CHUNK: tl.constexpr):
    cols = tl.arange(0, E_PAD)
    local = cols < num_local
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for c in range(0, num_blocks, NB):
        nb = c + tl.arange(0, NB)
        h = tl.load(hist_ptr + nb[:, None] * E_PAD + cols[None, :], mask=(nb < num_blocks)[:, None], other=0)
        counts += tl.sum(h, 0)
    padded = tl.where(local, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, 0)
    running = ends - padded                                  # each expert's first slot, then past each block
    for c in range(0, num_blocks, NB):
        nb = c + tl.arange(0, NB)
        live = (nb < num_blocks)[:, None]
        h = tl.load(hist_ptr + nb[:, None] * E_PAD + cols[None, :], mask=live, other=0)
        tl.store(offsets_ptr + nb[:, None] * E_PAD + cols[None, :], running[None, :] + tl.cumsum(h, 0) - h, mask=live)
        running += tl.sum(h, 0)
    for c in range(0, cap, CHUNK):                           # every slot starts as padding
        o = c + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + o, tl.zeros((CHUNK,), dtype=tl.int32) + pairs, mask=o < cap)
    total = tl.sum(padded, 0)
    tl.store(valid_ptr, total)
    for c in range(0, cap // BLOCK_M, BLOCKS_CHUNK):
        blk = c + tl.arange(0, BLOCKS_CHUNK)
        begin = blk * BLOCK_M
        owner = tl.sum(((ends[None, :] <= begin[:, None]) & local[None, :]).to(tl.int32), 1)
        tl.store(experts_ptr + blk, tl.where(begin < total, owner, -1), mask=blk < cap // BLOCK_M)


@triton.jit
def _align_place_kernel(ids_ptr, offsets_ptr, sorted_ids_ptr, pairs, num_local, K: tl.constexpr, TB: tl.constexpr,
                        E_PAD: tl.constexpr, P: tl.constexpr):
    b = tl.program_id(0)
    q = tl.arange(0, P)
    p = b * TB * K + q
    live = (q < TB * K) & (p < pairs)
    expert = tl.load(ids_ptr + p, mask=live, other=num_local).to(tl.int32)
    mine = live & (expert < num_local)
    before = (expert[None, :] == expert[:, None]) & (q[None, :] < q[:, None])      # [P (p), P (earlier q)]
    rank = tl.sum(before.to(tl.int32), 1)
    base = tl.load(offsets_ptr + b * E_PAD + expert, mask=mine, other=0)
    tl.store(sorted_ids_ptr + base + rank, p.to(tl.int32), mask=mine)


def wide_fits(tokens: int, num_experts: int, top_k: int) -> bool:
    """Whether `route_align_wide` takes a batch of this shape."""
    return ENABLED and 0 < tokens <= MAX_TOKENS and num_experts <= MAX_EXPERTS and next_power_of_2(top_k) <= PAIR_SLOTS


def route_align_wide(logits: torch.Tensor, top_k: int, softmax_first: bool, renormalize: bool, block_m: int,
                     first: int, num_local: int):
    """`route_align`'s outputs (weights [T, k] fp32, local ids [T, k] int64, sorted pair ids, expert per
    block, valid [1]) for a batch that `wide_fits`, in three launches."""
    require_triton(logits)
    tokens, num_experts = logits.shape
    e_pad, k_pad = next_power_of_2(num_experts), next_power_of_2(top_k)   # another rank's sentinel has no column
    tb = PAIR_SLOTS // k_pad
    num_blocks = triton.cdiv(tokens, tb)
    pairs, device = tokens * top_k, logits.device
    cap = padded_length(pairs, num_local, block_m)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=device)
    hist = torch.empty(num_blocks, e_pad, dtype=torch.int32, device=device)
    offsets = torch.empty(num_blocks, e_pad, dtype=torch.int32, device=device)
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=device)
    experts = torch.empty(cap // block_m, dtype=torch.int32, device=device)
    valid = torch.empty(1, dtype=torch.int32, device=device)
    _route_blocks_kernel[(num_blocks,)](logits, weights, ids, hist, tokens, num_experts, first, num_local,
                                        logits.stride(0), K=top_k, TB=tb, E_PAD=e_pad, K_PAD=k_pad,
                                        SOFTMAX_FIRST=softmax_first, RENORMALIZE=renormalize, num_warps=4)
    _align_offsets_kernel[(1,)](hist, offsets, sorted_ids, experts, valid, num_blocks, num_local, cap, pairs,
                                BLOCK_M=block_m, E_PAD=e_pad, NB=max(1, min(64, 4096 // e_pad)), CHUNK=1024,
                                BLOCKS_CHUNK=max(1, min(64, 4096 // e_pad)), num_warps=8)
    _align_place_kernel[(num_blocks,)](ids, offsets, sorted_ids, pairs, num_local, K=top_k, TB=tb, E_PAD=e_pad,
                                       P=PAIR_SLOTS, num_warps=4)
    return weights, ids, sorted_ids, experts, valid
