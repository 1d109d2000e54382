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

from ._triton import HAS_TRITON, _interpreting, next_power_of_2, tl, triton, use_pdl
from .moe_topk import route_rows
from .mxfp4 import GROUP, fp4_scale

# format -> the most (token, slot) pairs the GEMV path takes: each pair reads its expert's rows itself,
# so when several pairs share an expert the grouped GEMM's one read of it wins. 16-bit and fp8 take
# the grouped GEMMs (`fused_moe(gemv=True)` still runs them here)
GEMV_PAIRS = {"mxfp4": 64, "fp8": 0, "float": 0}
# (format, hidden, intermediate, experts) -> pairs: a shape's measured limit in place of GEMV_PAIRS'
# (bench/moe_gemv_sweep.py prints the entries its sweep supports)
GEMV_PAIRS_BY_SHAPE: dict[tuple[str, int, int, int], int] = {}
# format -> (BLOCK_N, BLOCK_K, num_warps, num_stages); mxfp4: a [16 groups, 8 rows] thread grid, 4 rows
# a thread, 360 programs of 4 warps a gpt-oss GEMM at T = 1 (one wave at 12 warps an SM; round 7)
GEMV_TILES = {"mxfp4": (32, 512, 4, 1), "fp8": (16, 256, 4, 3), "float": (16, 256, 4, 3)}
FORMATS = {"float": 0, "mxfp4": 1, "fp8": 2}
# the MXFP4 codes decoded by inline PTX (`_decode_ptx`) on the GPU; the interpreter runs the Triton ops
DECODE_ASM = True
# programmatic dependent launch for the MoE GEMVs and the sum over k (the dense kernels' setting, `use_pdl`, applies)
MOE_PDL = True


def gemv_pairs(fmt: str, hidden: int = 0, inter: int = 0, experts: int = 0) -> int:
    """The largest pair count that takes the GEMV path for experts of this format and shape."""
    return GEMV_PAIRS_BY_SHAPE.get((fmt, hidden, inter, experts), GEMV_PAIRS[fmt])


@triton.jit
def swiglu(gate, up, alpha, limit, OAI: tl.constexpr):
    """silu(gate) * up, or (OAI) gpt-oss's form: gate clamped above at `limit`, up to +-limit,
    gate * sigmoid(alpha * gate) * (up + 1). The epilogue of both MoE GEMM kernels."""
    if OAI:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return gate * tl.sigmoid(alpha * gate) * (up + 1.0)
    return gate * tl.sigmoid(gate) * up


# fp16 bit fields of a code's exponent-and-mantissa (bits 11-9) and sign (bit 15), in both halves of a word
_EM = tl.constexpr(0x0E000E00) if HAS_TRITON else None
_SIGN = tl.constexpr(0x80008000 - (1 << 32)) if HAS_TRITON else None    # as an int32 literal


def _decode_ptx() -> str:
    """$8: a word of 8 e2m1 codes (code m in bits 4m-4m+3); out $0-$7: the values times 2^-14 in
    fp32. Codes m and m + 4 land in one word as two fp16 bit patterns (sign bit 15, exponent and
    mantissa bits 11-9, as `fp4_weight_tiles` places them), each half converted straight from its
    register (Triton's own 16-bit lowering re-packs the halves first, a PRMT a pair). For m < 3 one
    lop3 takes the sign bits from w << 3 and the rest from w, so one shift and one mask place both
    fields: 13 integer ops a word, then 8 conversions."""
    lines = ["{ .reg .b32 y, t, r;", ".reg .b16 l, h;", "shl.b32 y, $8, 3;"]
    for m in range(4):
        if m < 3:
            signs = (1 << (4 * m + 6)) | (1 << (4 * m + 22))         # the sign bits of codes m, m + 4 in y
            lines += [f"lop3.b32 t, $8, y, {signs:#x}, 0xD8;",       # (w & ~signs) | (y & signs)
                      f"shl.b32 t, t, {9 - 4 * m};", "and.b32 r, t, 0x8E008E00;"]
        else:                                                        # code 7's sign is bit 31: w itself
            lines += ["shr.u32 t, $8, 3;", "and.b32 t, t, 0x0E000E00;", "lop3.b32 r, $8, 0x80008000, t, 0xEA;"]
        lines += ["mov.b32 {l, h}, r;", f"cvt.f32.f16 ${m}, l;", f"cvt.f32.f16 ${m + 4}, h;"]
    return "\n".join(lines + ["}"])


_DECODE_PTX = tl.constexpr(_decode_ptx()) if HAS_TRITON else None


@triton.jit
def _fp4_word(w, ASM: tl.constexpr):
    """int32 words of 8 e2m1 codes -> their 8 values times 2^-14, fp32 (element order)."""
    if ASM:
        return tl.inline_asm_elementwise(_DECODE_PTX, "=f,=f,=f,=f,=f,=f,=f,=f,r", [w], dtype=(tl.float32,) * 8,
                                         is_pure=True, pack=1)
    v0, v4 = _f16_halves(((w << 9) & _EM) | ((w << 12) & _SIGN))
    v1, v5 = _f16_halves(((w << 5) & _EM) | ((w << 8) & _SIGN))
    v2, v6 = _f16_halves(((w << 1) & _EM) | ((w << 4) & _SIGN))
    v3, v7 = _f16_halves(((w >> 3) & _EM) | (w & _SIGN))
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _f16_halves(r):
    """int32 words of two fp16 bit patterns -> (low half, high half) as fp32."""
    lo = r.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (r >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _bf16_halves(a):
    """int32 words of two bf16 values -> (low, high) as fp32: a bf16 is the top half of its fp32."""
    return (a << 16).to(tl.float32, bitcast=True), (a & -65536).to(tl.float32, bitcast=True)


@triton.jit
def fp4_group_dot(w, s, a_ptrs, g0, a_mask, A_WORDS: tl.constexpr, ASM: tl.constexpr):
    """One step of an MXFP4 dot: the activations of 32-value group g0 (bf16 pairs packed in int32
    words when A_WORDS, else one value each) times the packed fp4 words `w`, summed over each
    word's 8 values and scaled by the groups' e8m0 scales `s`."""
    if A_WORDS:
        a0, a1 = _bf16_halves(tl.load(a_ptrs + g0 * 16, mask=a_mask, other=0))
        a2, a3 = _bf16_halves(tl.load(a_ptrs + g0 * 16 + 1, mask=a_mask, other=0))
        a4, a5 = _bf16_halves(tl.load(a_ptrs + g0 * 16 + 2, mask=a_mask, other=0))
        a6, a7 = _bf16_halves(tl.load(a_ptrs + g0 * 16 + 3, mask=a_mask, other=0))
    else:
        a0 = tl.load(a_ptrs + g0 * 32, mask=a_mask, other=0.0).to(tl.float32)
        a1 = tl.load(a_ptrs + g0 * 32 + 1, mask=a_mask, other=0.0).to(tl.float32)
        a2 = tl.load(a_ptrs + g0 * 32 + 2, mask=a_mask, other=0.0).to(tl.float32)
        a3 = tl.load(a_ptrs + g0 * 32 + 3, mask=a_mask, other=0.0).to(tl.float32)
        a4 = tl.load(a_ptrs + g0 * 32 + 4, mask=a_mask, other=0.0).to(tl.float32)
        a5 = tl.load(a_ptrs + g0 * 32 + 5, mask=a_mask, other=0.0).to(tl.float32)
        a6 = tl.load(a_ptrs + g0 * 32 + 6, mask=a_mask, other=0.0).to(tl.float32)
        a7 = tl.load(a_ptrs + g0 * 32 + 7, mask=a_mask, other=0.0).to(tl.float32)
    v0, v1, v2, v3, v4, v5, v6, v7 = _fp4_word(w, ASM)
    part = v0 * a0 + v1 * a1 + v2 * a2 + v3 * a3 + v4 * a4 + v5 * a5 + v6 * a6 + v7 * a7
    return tl.sum(part, 2) * fp4_scale(s)


@triton.jit
def _mxfp4_dot(a_ptr, w_ptr, s_ptr, rows, mask_n, a_row, K, stride_am, stride_wn, stride_sn,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A_WORDS: tl.constexpr, ASM: tl.constexpr):
    """sum_k a[a_row, k] * W[row, k] for MXFP4 rows as fp32 [BLOCK_N]. `w_ptr`: the codes as int32
    words (8 values each; row stride `stride_wn` in words), a step a [groups, BLOCK_N, 4 words] tile
    (a group's 16 bytes in one load), the next step's codes and scales loaded before this one's
    arithmetic (the loop is not pipelined otherwise: these loads feed no dot). Each word decodes to
    8 fp32 values (`_fp4_word`), one FMA each against the activations, the group's sum times its
    scale. `A_WORDS`: the activations are bf16 read as int32 words (2 values each, row stride in
    words), unpacked by a shift or a mask; else any float dtype, one load per value."""
    G: tl.constexpr = BLOCK_K // 32
    # group-major tiles: a thread's registers repeat down the rows (Triton orders dimensions of
    # equal contiguity by index), so its activations serve all of its rows
    g = tl.arange(0, G)
    q = tl.arange(0, 4)
    row_off = tl.multiple_of(rows * stride_wn, 4)                          # rows start on 16 bytes
    w_ptrs = w_ptr + row_off[None, :, None] + (g[:, None, None] * 4 + q[None, None, :])
    s_ptrs = s_ptr + rows[None, :] * stride_sn + g[:, None]
    if A_WORDS:                                                            # 4 activation words a code word
        a_ptrs = a_ptr + a_row * stride_am + (g[:, None, None] * 16 + 4 * q[None, None, :])
    else:
        a_ptrs = a_ptr + a_row * stride_am + (g[:, None, None] * 32 + 8 * q[None, None, :])
    groups = K // 32
    acc = tl.zeros((G, BLOCK_N), dtype=tl.float32)
    live = g < groups
    w_next = tl.load(w_ptrs, mask=live[:, None, None] & mask_n[None, :, None], other=0)
    s_next = tl.load(s_ptrs, mask=live[:, None] & mask_n[None, :], other=127)
    for g0 in range(0, groups, G):
        w, s = w_next, s_next
        a_live = live[:, None, None]
        live = (g + g0 + G) < groups
        w_next = tl.load(w_ptrs + (g0 + G) * 4, mask=live[:, None, None] & mask_n[None, :, None], other=0)
        s_next = tl.load(s_ptrs + g0 + G, mask=live[:, None] & mask_n[None, :], other=127)
        acc += fp4_group_dot(w, s, a_ptrs, g0, a_live, A_WORDS, ASM)
    return tl.sum(acc, 0)


@triton.jit
def _row_dot(a_ptr, w_ptr, s_ptr, rows, mask_n, a_row, K, stride_am, stride_wn, stride_sn,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FORMAT: tl.constexpr, A_WORDS: tl.constexpr,
             ASM: tl.constexpr):
    """sum_k a[a_row, k] * W[row, k] for the BLOCK_N rows at `rows` ([BLOCK_N] int64 offsets of
    this expert's rows) as fp32 [BLOCK_N]; e4m3 codes come back unscaled (the caller's epilogue)."""
    if FORMAT == 1:
        return _mxfp4_dot(a_ptr, w_ptr, s_ptr, rows, mask_n, a_row, K, stride_am, stride_wn, stride_sn,
                          BLOCK_N, BLOCK_K, A_WORDS, ASM)
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
                     E, first, stride_lt,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr, OAI: tl.constexpr,
                     HAS_BIAS: tl.constexpr, FORMAT: tl.constexpr, MUL_WEIGHTS: tl.constexpr,
                     A_WORDS: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr, ROUTE: tl.constexpr,
                     TOP_K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                     SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr):
    """out[pair, n] = a[pair // rows_per_a] . W[ids[pair], n] (+ bias), the epilogues of
    `_moe_gemm_kernel` (same arguments, with the flat expert ids in place of the alignment).
    ROUTE: `ids_ptr` is the router logits [T, E] instead (row stride `stride_lt`): the program
    routes its pair's token itself (`route_rows`; slot pair % TOP_K, this rank's experts from
    `first`) and takes its routing weight from there, so no routing launch precedes the GEMVs."""
    if USE_PDL:                                 # launched while the routing drains: wait for its ids
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pair = tl.program_id(0)
    if ROUTE:
        token = pair // TOP_K
        w_row, sel, _ = route_rows(ids_ptr, token + tl.arange(0, 1), token + 1, E, stride_lt, TOP_K, E_PAD, K_PAD,
                                   SOFTMAX_FIRST, RENORMALIZE)
        pick = tl.arange(0, K_PAD)[None, :] == pair % TOP_K
        expert = (tl.sum(tl.where(pick, sel, 0)) - first).to(tl.int64)
        route_weight = tl.sum(tl.where(pick, w_row, 0.0))
        if expert < 0:                          # before this rank's first expert
            return
    else:
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        route_weight = 0.0
    if expert >= num_experts:                   # another rank's expert: its row stays as it is
        return
    a_row = (pair // rows_per_a).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    acc = _row_dot(a_ptr, w_base, s_base, rows, mask_n, a_row, K, stride_am, stride_wn, stride_sn,
                   BLOCK_N, BLOCK_K, FORMAT, A_WORDS, ASM)
    if FORMAT == 2:
        acc *= tl.load(s_base + offs_n * stride_sn, mask=mask_n, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if SWIGLU:                                  # the up rows sit N rows below the gate rows
        up = _row_dot(a_ptr, w_base, s_base, rows + N, mask_n, a_row, K, stride_am, stride_wn, stride_sn,
                      BLOCK_N, BLOCK_K, FORMAT, A_WORDS, ASM)
        if FORMAT == 2:
            up *= tl.load(s_base + (offs_n + N) * stride_sn, mask=mask_n, other=0.0)
        if HAS_BIAS:
            up += tl.load(bias_ptr + expert * stride_be + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc = swiglu(acc, up, alpha, limit, OAI)
    if MUL_WEIGHTS:
        acc = acc * (route_weight if ROUTE else tl.load(weights_ptr + pair))
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def launch_gemv(a: torch.Tensor, weight_args: tuple, bias: torch.Tensor | None, out: torch.Tensor,
                ids: torch.Tensor, weights: torch.Tensor, n: int, k: int, rows_per_a: int, *, swiglu: bool,
                oai: bool, mul_weights: bool, alpha: float, limit: float, tile=None, route=None) -> None:
    """One GEMM of `fused_moe` as GEMVs over the flat ids [pairs] (int64). `weight_args`: what
    kernels/moe.py's `_weight_args` returns for the projection; `tile`: (BLOCK_N, BLOCK_K, warps,
    stages) in place of GEMV_TILES' (the sweep of `bench kernels --part moe_tiles`). `route`:
    (top_k, order, renormalize, first) with `ids` the router logits [T, E] (each program routes
    its own pair; `weights` unused)."""
    w, s, swe, swn, sse, ssn, fmt = weight_args
    block_n, block_k, warps, stages = tile or GEMV_TILES[fmt]
    a_arg, stride_am, a_words = a, a.stride(0), False
    if fmt == "mxfp4":
        block_k = max(GROUP, block_k)
        w, swe, swn = w.view(torch.int32), swe // 4, swn // 4      # 8 codes a word; K % 32 == 0
        # bf16 rows as int32 words of two values (rows of even length and offset)
        a_words = a.dtype == torch.bfloat16 and a.stride(1) == 1 and a.stride(0) % 2 == 0 and \
            a.storage_offset() % 2 == 0
        if a_words:
            a_arg, stride_am = a.view(torch.int32), a.stride(0) // 2
    bias_t = bias.contiguous() if bias is not None else a
    top_k, order, renormalize, first = route or (1, "softmax_topk", False, 0)
    pairs = ids.shape[0] * top_k if route else ids.numel()
    num_logits = ids.shape[1] if route else 1
    grid = (pairs, triton.cdiv(n, block_n))
    pdl = MOE_PDL and use_pdl(a)
    _moe_gemv_kernel[grid](a_arg, w, s, bias_t, out, ids, weights, n, k, w.shape[0], rows_per_a, alpha, limit,
                           stride_am, swe, swn, sse, ssn, bias_t.stride(0), out.stride(0),
                           num_logits, first, ids.stride(0) if route else 0,
                           BLOCK_N=block_n, BLOCK_K=block_k, SWIGLU=swiglu, OAI=oai, HAS_BIAS=bias is not None,
                           FORMAT=FORMATS[fmt], MUL_WEIGHTS=mul_weights, A_WORDS=a_words,
                           ASM=DECODE_ASM and not _interpreting(), USE_PDL=pdl, ROUTE=route is not None,
                           TOP_K=top_k, E_PAD=next_power_of_2(num_logits), K_PAD=next_power_of_2(top_k),
                           SOFTMAX_FIRST=order == "softmax_topk", RENORMALIZE=renormalize,
                           num_warps=warps, num_stages=stages, launch_pdl=pdl)
