"""Mixture-of-experts: routing, and the fused grouped GEMMs that apply the selected experts.

Routing (`route`): router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64), with
the model's order: "softmax_topk" (softmax over all experts, then the top k: Mixtral, Qwen3-MoE)
or "topk_softmax" (top k logits, then a softmax over them: gpt-oss), and optional
renormalisation of the k weights to sum to one.

The fused path (`fused_moe`), for a SwiGLU expert MLP with gate and up stacked in `w13`:
1. `align`: the T*k (token, slot) pairs sorted by expert, each expert's run padded to a multiple
   of BLOCK_M with the sentinel T*k, and the expert of each BLOCK_M block. All on the device with
   a static upper bound on the padded length (T*k + E*(BLOCK_M-1)), so it needs no host sync and
   runs inside CUDA graphs.
2. gate-up GEMM: one program per (block of BLOCK_M pairs, BLOCK_N columns of the intermediate
   size); it multiplies the pairs' token rows by its expert's gate and up tiles and writes
   silu(gate) * up, so the [T*k, 2I] intermediate never reaches memory.
3. down GEMM: the same grid over the hidden size, each row scaled by its routing weight in the
   epilogue; the k rows of a token are then summed.
Both GEMMs take optional per-expert biases (added before the activation and before the routing
weight), gpt-oss's clamped SwiGLU in place of silu(gate) * up, MXFP4 weights (kernels/mxfp4.py:
4-bit codes and a scale per 32, decoded tile by tile in registers, so only the codes are read) and
fp8 weights (kernels/moe_fp8.py: e4m3 codes widened tile by tile to the activations' dtype, the
per-row scales applied to the fp32 accumulators in the epilogue, before the biases).
Each expert's weights are read once per column tile for all the pairs routed to it, which makes
decode (few pairs per expert) a pass over the selected experts' bytes.

MXFP4 batches of up to 64 rows an expert (a prefill's or a large decode batch's) take
kernels/moe_rows.py instead: the same layout at 16-row blocks, computed transposed, so the decoded
tile is the MMA's left operand (registers) and the block's rows its narrow right one.

`moe_reference` is the plain torch computation the kernels are tested against and the CPU path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import require_triton, tl, triton, use_pdl
from .moe_decode import gemv_moe, topk_sum
from .moe_fp8 import Fp8Stack
from .moe_gemv import MOE_PDL, gemv_pairs, swiglu
from .moe_rows import ROWS_BLOCK_M, launch_rows, rows_path
from .mxfp4 import Mxfp4Stack, fp4_weight_tiles

ROUTING_ORDERS = ("softmax_topk", "topk_softmax")


def route(logits: torch.Tensor, top_k: int, order: str = "softmax_topk",
          renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    if order not in ROUTING_ORDERS:
        raise ValueError(f"unknown routing order {order!r}; supported: {', '.join(ROUTING_ORDERS)}")
    if not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({logits.shape[-1]})")
    logits = logits.float()
    if order == "softmax_topk":
        weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        top, ids = logits.topk(top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    return weights, ids


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def moe_reference(x: torch.Tensor, w13, w2, weights: torch.Tensor, ids: torch.Tensor,
                  w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  activation=silu_mul) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], weights/ids [T, k].

    `w13`/`w2` may be any stack that `[e]` indexes to one expert's float matrix (MXFP4 experts
    dequantize there, one selected expert at a time). Ids >= E name experts held by another rank
    (expert parallelism) and are skipped. Biases [E, 2I] / [E, H] are added before the activation
    and before the routing weight; `activation(gate, up) -> [n, I]` (SwiGLU by default)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    num_experts = w13.shape[0]
    for expert in ids.unique().tolist():
        if expert >= num_experts:
            continue
        rows, slots = (ids == expert).nonzero(as_tuple=True)
        h = x[rows].float() @ w13[expert].float().t()
        if w13_bias is not None:
            h = h + w13_bias[expert].float()
        gate, up = h.chunk(2, dim=-1)
        y = activation(gate, up) @ w2[expert].float().t()
        if w2_bias is not None:
            y = y + w2_bias[expert].float()
        out.index_add_(0, rows, y * weights[rows, slots, None].float())
    return out.to(x.dtype)


def padded_length(pairs: int, num_experts: int, block_m: int) -> int:
    """Slots for `pairs` sorted by expert with each expert's run padded to block_m: at most
    min(E + 1, pairs) runs (the +1: another rank's experts) each waste block_m - 1, rounded up to
    block_m. Also the GEMMs' grid over M, so a decode batch launches only the blocks it can fill
    (batch 1 of a 128-expert model: 8 blocks, not 122)."""
    return -(-(pairs + min(num_experts + 1, pairs) * (block_m - 1)) // block_m) * block_m


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted pair ids [P], expert per block [P / block_m], valid length [1]) for ids [T, k];
    P = `padded_length` (a bound that depends on shapes only).
    Ids equal to E (experts of another rank) sort last, past the valid length, so no block runs them."""
    flat = ids.flatten()
    pairs = flat.numel()
    bins = num_experts + 1
    cap = padded_length(pairs, num_experts, block_m)
    # scatter_add rather than bincount: bincount syncs with the host, which a CUDA graph cannot hold
    counts = torch.zeros(bins, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(pairs, device=ids.device) - (counts.cumsum(0) - counts)[sorted_experts]
    sorted_ids = torch.full((cap,), pairs, dtype=torch.int32, device=ids.device)
    sorted_ids[starts[sorted_experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, cap, block_m, device=ids.device)
    expert_of_block = torch.searchsorted(ends, block_starts, right=True)
    expert_of_block = torch.where(expert_of_block < num_experts, expert_of_block, -1).to(torch.int32)
    return sorted_ids, expert_of_block, ends[num_experts - 1:num_experts].to(torch.int32)


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, sorted_ids_ptr, experts_ptr, valid_ptr, weights_ptr,
                     N, K, num_pairs, rows_per_a, alpha, limit,
                     stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SWIGLU: tl.constexpr, OAI: tl.constexpr, HAS_BIAS: tl.constexpr, MXFP4: tl.constexpr,
                     FP8: tl.constexpr, MUL_WEIGHTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    """out[pair] = a[row of pair] @ W[expert]^T (+ bias) for the pairs of each BLOCK_M block.
    W is [E, N (x2 with SWIGLU: gate rows, then up rows), K] in the activations' dtype, or (MXFP4)
    bytes [E, N, K / 2] with scales [E, N, K / 32], or (FP8) e4m3 [E, N, K] with fp32 scales [E, N]
    (one a row, so they scale the accumulators after the K loop). SWIGLU writes silu(gate) * up, or with OAI
    gpt-oss's clamped form; MUL_WEIGHTS scales each row by its routing weight. DOT_PRECISION is
    "ieee" for fp32 activations: Triton's default for fp32 dots on NVIDIA is TF32, whose 10-bit
    inputs move a tiny model's router past a near-tie and change whole tokens. USE_PDL: launched as
    a programmatic dependent of the kernel before (the routing, or the gate-up GEMM), its programs
    resident before that one ends; every input is read after the wait."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(valid_ptr):
        return
    expert = tl.load(experts_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    mask_m = pair < num_pairs
    a_row = (pair // rows_per_a).to(tl.int64)      # the token (gate-up) or the pair itself (down)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rows = offs_n[None, :].to(tl.int64)
    if MXFP4:   # bytes: k = 2j (low nibble) and 2j + 1 (high) of byte j; the activations split to match
        offs_j = tl.arange(0, BLOCK_K // 2)
        a_ptrs = a_ptr + a_row[:, None] * stride_am + 2 * offs_j[None, :]
        w_ptrs = w_ptr + expert * stride_we + rows * stride_wn + offs_j[:, None]
        s_ptrs = s_ptr + expert * stride_se + rows * stride_sn + (offs_j // 16)[:, None]
        for k0 in range(0, K, BLOCK_K):
            mask_j = offs_j < (K - k0) // 2
            mask_a = mask_m[:, None] & mask_j[None, :]
            mask_w = mask_j[:, None] & mask_n[None, :]
            a_even = tl.load(a_ptrs, mask=mask_a, other=0.0)
            a_odd = tl.load(a_ptrs + 1, mask=mask_a, other=0.0)
            lo, hi = fp4_weight_tiles(w_ptrs + k0 // 2, s_ptrs + k0 // 32, mask_w)
            acc += tl.dot(a_even, lo.to(a_even.dtype), input_precision=DOT_PRECISION)
            acc += tl.dot(a_odd, hi.to(a_odd.dtype), input_precision=DOT_PRECISION)
            if SWIGLU:   # the up rows sit N rows below the gate rows
                lo, hi = fp4_weight_tiles(w_ptrs + N * stride_wn + k0 // 2, s_ptrs + N * stride_sn + k0 // 32,
                                           mask_w)
                acc_up += tl.dot(a_even, lo.to(a_even.dtype), input_precision=DOT_PRECISION)
                acc_up += tl.dot(a_odd, hi.to(a_odd.dtype), input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
    else:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
        w_ptrs = w_ptr + expert * stride_we + rows * stride_wn + offs_k[:, None]
        for k0 in range(0, K, BLOCK_K):
            mask_k = offs_k < K - k0
            mask_w = mask_k[:, None] & mask_n[None, :]
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=mask_w, other=0.0).to(a.dtype)        # FP8: exact in a's dtype
            acc += tl.dot(a, w, input_precision=DOT_PRECISION)
            if SWIGLU:
                u = tl.load(w_ptrs + N * stride_wn + k0, mask=mask_w, other=0.0).to(a.dtype)
                acc_up += tl.dot(a, u, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
        if FP8:      # each output row's scale, on the products (before the bias: it is not quantized)
            sc_ptrs = s_ptr + expert * stride_se + offs_n * stride_sn
            acc *= tl.load(sc_ptrs, mask=mask_n, other=0.0)[None, :]
            if SWIGLU:
                acc_up *= tl.load(sc_ptrs + N * stride_sn, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        b_ptrs = bias_ptr + expert * stride_be + offs_n
        acc += tl.load(b_ptrs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            acc_up += tl.load(b_ptrs + N, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        acc = swiglu(acc, acc_up, alpha, limit, OAI)
    if MUL_WEIGHTS:
        acc = acc * tl.load(weights_ptr + pair, mask=mask_m, other=0.0)[:, None]
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


_SM_COUNT: dict[int, int] = {}
NUM_STAGES = 3                      # Triton's default on CUDA, which the launches keep
SHARED_MEMORY_BUDGET = 200 * 1024   # below the H100/H200 227 KiB per block, with room for the epilogue


def _block_config(num_pairs: int, element_size: int = 2) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): decode-sized pair counts take the smallest M tile. 4-byte
    (fp32) activations halve BLOCK_K, so the pipelined tiles stay within SHARED_MEMORY_BUDGET."""
    if num_pairs <= 64:
        bm, bn, bk = 16, 64, 128
    elif num_pairs <= 1024:
        bm, bn, bk = 32, 64, 64
    else:
        bm, bn, bk = 64, 128, 64
    return bm, bn, bk if element_size <= 2 else bk // 2


def alignment_block(num_pairs: int, element_size: int = 2) -> int:
    """The M tile `fused_moe` runs num_pairs at: the block size its alignment pads to."""
    return _block_config(num_pairs, element_size)[0]


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _tile(num_pairs: int, element_size: int, mxfp4: bool, n: int | None = None, experts: int | None = None,
          sms: int = 132) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of one GEMM of output width `n` over `experts`.
    A decode batch whose column tiles of every expert it can select (at most min(pairs, E)) would
    not fill the GPU twice over takes BLOCK_N 32 (Mixtral's down GEMM at batch 1: 128 programs of
    64 columns on 132 SMs, each walking 14336 values; 256 of 32). MXFP4 decodes each weight tile in
    registers (a byte, a scale byte and five integer temporaries per value): at BLOCK_K 128 and
    4 warps that is some 400 registers a thread, so it takes BLOCK_K 64 over 8 warps (16 values
    a thread for each). 16-bit decode batches (<= 64 pairs) take BLOCK_N 32 over 2 warps and 4
    stages: the best of `bench kernels --part moe_tiles` on the H200 for Mixtral at T = 1 (92.9%
    of the read rate against 86.6% for the earlier (64 | 32, 128, 4 warps, 3 stages); qwen3-30b-a3b
    43% either way; 2026-12-02 round 4 in BENCHMARKS.md)."""
    _, block_n, block_k = _block_config(num_pairs, element_size)
    selectable = min(num_pairs, experts or num_pairs)
    if num_pairs <= 64 and n is not None and selectable * triton.cdiv(n, block_n) < 2 * sms:
        block_n = 32
    if mxfp4:
        return block_n, min(block_k, 64), 8, NUM_STAGES
    if num_pairs <= 64 and element_size <= 2:
        return 32, block_k, 2, 4
    return block_n, block_k, 4, NUM_STAGES


def shared_memory_bytes(block_m: int, block_n: int, block_k: int, element_size: int) -> int:
    """What the gate-up launch's pipelined tiles hold: an activation tile and the gate and up
    weight tiles, in the activations' dtype, for each of NUM_STAGES stages."""
    return NUM_STAGES * (block_m * block_k + 2 * block_k * block_n) * element_size


def weight_format(w) -> str:
    """A projection's expert format, as `_weight_args` names it: "mxfp4", "fp8" or "float"."""
    return "mxfp4" if isinstance(w, Mxfp4Stack) else "fp8" if isinstance(w, Fp8Stack) else "float"


def _weight_args(w) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int, str]:
    """(codes or weights, scales, expert and row strides of each, format) for one projection; the
    format is "mxfp4", "fp8" or "float"."""
    if isinstance(w, Mxfp4Stack):
        blocks = w.blocks.reshape(*w.blocks.shape[:2], -1).contiguous()     # [E, N, K / 2] bytes
        scales = w.scales.contiguous()                                      # [E, N, K / 32]
        return blocks, scales, blocks.stride(0), blocks.stride(1), scales.stride(0), scales.stride(1), "mxfp4"
    if isinstance(w, Fp8Stack):
        codes, scales = w.codes.contiguous(), w.scales.contiguous()         # [E, N, K] e4m3, [E, N] fp32
        return codes, scales, codes.stride(0), codes.stride(1), scales.stride(0), scales.stride(1), "fp8"
    w = w.contiguous()
    return w, w, w.stride(0), w.stride(1), 0, 0, "float"


def _rows_moe(x, w13_args, w2_args, weights, ids, w13_bias, w2_bias, oai, alpha, limit, all_local,
              alignment=None) -> torch.Tensor:
    """`fused_moe` through the MXFP4 row path (kernels/moe_rows.py): up to 64 rows an expert.
    `alignment`: `align`'s result at ROWS_BLOCK_M, when the caller has it."""
    tokens, hidden = x.shape
    num_experts, inter, top_k = w13_args[0].shape[0], w13_args[0].shape[1] // 2, ids.shape[1]
    pairs = tokens * top_k
    alignment = alignment if alignment is not None else align(ids, num_experts, ROWS_BLOCK_M)
    flat_weights = weights.reshape(-1).float().contiguous()
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    launch_rows(x, w13_args, w13_bias, act, alignment, flat_weights, inter, hidden, pairs, top_k, swiglu=True,
                oai=oai, mul_weights=False, alpha=alpha, limit=limit)
    # zeros: pairs of another rank's experts are never written, and the sum over k reads them
    out = (torch.empty if all_local else torch.zeros)(pairs, hidden, dtype=torch.float32, device=x.device)
    launch_rows(act, w2_args, w2_bias, out, alignment, flat_weights, hidden, inter, pairs, 1, swiglu=False,
                oai=False, mul_weights=True, alpha=alpha, limit=limit)
    return topk_sum(out.view(tokens, top_k, hidden), x.dtype)


def fused_moe(x: torch.Tensor, w13, w2, weights: torch.Tensor, ids: torch.Tensor,
              w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
              activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
              alignment: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              all_local: bool = False, tile: tuple[int, int, int, int] | None = None,
              gemv: bool | None = None) -> torch.Tensor:
    """The Triton path of `moe_reference` (same result up to rounding): w13/w2 are float stacks in
    x's dtype, `Mxfp4Stack`s (decoded inside the GEMMs, so the experts stay 4-bit in memory) or
    `Fp8Stack`s (e4m3 widened inside the GEMMs, the row scales in their epilogues);
    optional biases; activation "silu" or "swiglu_oai" (gpt-oss: clamp at `limit`, sigmoid gain
    `alpha`, up + 1). Ids equal to E (another rank's experts) contribute nothing. `alignment`:
    `align`'s result for these ids at `alignment_block(T * k, x.element_size())`, when the caller
    has it already (kernels/moe_routing.py computes it with the routing; at ROWS_BLOCK_M where the
    MXFP4 row path takes the batch). `all_local`: no id is
    another rank's (no expert parallelism), so every pair's row gets written and needs no zeroing.
    `tile`: (BLOCK_N, BLOCK_K, num_warps, num_stages) in place of the table's (the tile sweep of
    `tokenforge bench kernels --part moe_tiles`; the GEMV's own tile when it runs). `gemv`: run the
    GEMV path (kernels/moe_decode.py: per-pair gate-up and down GEMVs, then `topk_sum`);
    None decides by the weight format, the shape and the pair count (`gemv_pairs`)."""
    require_triton(x)
    tokens, hidden = x.shape
    num_experts, two_inter = w13.shape[0], w13.shape[1]
    inter, top_k = two_inter // 2, ids.shape[1]
    pairs = tokens * top_k
    block_m = alignment_block(pairs, x.element_size())
    precision = "ieee" if x.dtype == torch.float32 else "tf32"      # tf32 is ignored for 16-bit inputs
    x = x.contiguous()
    oai = activation == "swiglu_oai"
    w13_args, w2_args = _weight_args(w13), _weight_args(w2)
    if gemv if gemv is not None else pairs <= gemv_pairs(w13_args[-1], hidden, inter, num_experts):
        return gemv_moe(x, w13_args, w2_args, top_k, ids, weights, w13_bias, w2_bias, oai=oai, alpha=alpha,
                        limit=limit, all_local=all_local, tile=tile)
    if rows_path(w13_args[-1], pairs, num_experts):
        return _rows_moe(x, w13_args, w2_args, weights, ids, w13_bias, w2_bias, oai, alpha, limit, all_local,
                         alignment)
    sorted_ids, experts, valid = alignment if alignment is not None else align(ids, num_experts, block_m)
    pdl = MOE_PDL and use_pdl(x)
    w, s, swe, swn, sse, ssn, fmt = w13_args
    sms = _sm_count(x.device)
    block_n, block_k, warps, stages = tile or _tile(pairs, x.element_size(), fmt == "mxfp4", inter, num_experts, sms)
    bias = w13_bias.contiguous() if w13_bias is not None else x
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    grid = (sorted_ids.numel() // block_m, triton.cdiv(inter, block_n))
    _moe_gemm_kernel[grid](x, w, s, bias, act, sorted_ids, experts, valid, weights, inter, hidden, pairs, top_k,
                           alpha, limit, x.stride(0), swe, swn, sse, ssn, bias.stride(0), act.stride(0),
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SWIGLU=True, OAI=oai,
                           HAS_BIAS=w13_bias is not None, MXFP4=fmt == "mxfp4", FP8=fmt == "fp8", MUL_WEIGHTS=False,
                           DOT_PRECISION=precision, USE_PDL=pdl,
                           num_warps=warps, num_stages=stages, launch_pdl=pdl)
    # zeros: pairs of another rank's experts are never written, and the sum over k reads them
    out = (torch.empty if all_local else torch.zeros)(pairs, hidden, dtype=torch.float32, device=x.device)
    flat_weights = weights.reshape(-1).float().contiguous()
    w, s, swe, swn, sse, ssn, fmt = w2_args
    block_n, block_k, warps, stages = tile or _tile(pairs, x.element_size(), fmt == "mxfp4", hidden, num_experts, sms)
    bias = w2_bias.contiguous() if w2_bias is not None else x
    grid = (sorted_ids.numel() // block_m, triton.cdiv(hidden, block_n))
    _moe_gemm_kernel[grid](act, w, s, bias, out, sorted_ids, experts, valid, flat_weights, hidden, inter, pairs, 1,
                           alpha, limit, act.stride(0), swe, swn, sse, ssn, bias.stride(0), out.stride(0),
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SWIGLU=False, OAI=False,
                           HAS_BIAS=w2_bias is not None, MXFP4=fmt == "mxfp4", FP8=fmt == "fp8", MUL_WEIGHTS=True,
                           DOT_PRECISION=precision, USE_PDL=pdl,
                           num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return topk_sum(out.view(tokens, top_k, hidden), x.dtype)
