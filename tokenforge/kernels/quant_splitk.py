"""Split-K dequant GEMV / small GEMM for decode batches: y = x @ dequant(W)^T for M = 1 to 16 rows.

The successor of quant_gemv.py's kernel for the weight-only linears, designed against what kept
that one at 0.9 (int4) and 1.7-2.0 TB/s (int8) on the H200:
- the kernel owns the int4 layout (`repack_int4`, at load): int32 words [N, K/8]; in each K tile
  of BLOCK_K inputs, nibble i of word j is input k0 + i * C + j (C = BLOCK_K / 8). So nibble i of
  every word pairs with one contiguous run of C inputs: a thread's 16-byte load is 32 weights, a
  shift and a mask give them in input order, and no interleave (join + reshape) is needed;
- split-K over programs (grid: N / BLOCK_N x split_k), so every shape fills the 132 SMs several
  times; partial sums go to an fp32 workspace and the last program of each N tile to arrive (a
  per-tile counter, reset by that program) adds them, applies scale and bias and stores y: one
  launch, no memset;
- scales and zeros transposed to [K/G, N] (`repack_groups`): a chunk's BLOCK_N values are one
  coalesced load; the zero point and scale apply once per (row, group) to the group's sum;
- every program handles all M rows of its weight tile, so the weight is read once for M = 1..16.
  `dot=True`: tensor cores, M padded to 16; int4 feeds them 128 + q as bf16 (the magic-exponent
  bits, one mask and one OR per weight, no converter) and subtracts (128 + z) * sum(x) per group;
  `dot=False`: CUDA-core FMAs (M <= 4).
Quant kinds: QUANT_CHANNEL (int8 / e4m3 [N, K], fp32 scale per row, weight-only), QUANT_INT4,
QUANT_FP8_A8 (e4m3 weights times e4m3 activations quantized in the kernel's prologue with one
scale per (token, BLOCK_K block) from the block's amax: W8A8 with the activation quantization
fused, finer than per-token). Each has a torch reference (`splitk_ref`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._triton import HAS_TRITON, next_power_of_2, require_triton, tl, triton, use_pdl
from .quant_layout import repack_groups, repack_int4, unrepack_int4

QUANT_CHANNEL, QUANT_INT4, QUANT_FP8_A8 = 1, 2, 3
FP8_MAX = 448.0


class SplitKConfig(NamedTuple):
    block_n: int
    block_k: int        # int4: also the layout's tile (repack_int4), fixed per layer at load
    split_k: int
    dot: bool = True
    num_warps: int = 4
    stages: int = 1     # 1: the loop keeps one weight tile in flight by hand; >1: Triton's pipeliner
    asm: bool = True    # int4 on tensor cores: the nibbles -> bf16 by inline PTX (CUDA; else Triton ops)


# ---- layouts and torch references -------------------------------------------------------------

def quantize_act_blocks_ref(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """x [M, K] -> x fake-quantized to e4m3 with one scale per (row, block of block_k inputs)."""
    m, k = x.shape
    xb = x.float().reshape(m, -1, block_k)
    scale = (xb.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    return ((xb / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale).reshape(m, k)


def splitk_ref(quant: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               block_k: int = 128) -> torch.Tensor:
    """y for the dequantized weight [N, K] (fp32 products); QUANT_FP8_A8 fake-quantizes x first."""
    xf = quantize_act_blocks_ref(x, block_k) if quant == QUANT_FP8_A8 else x.float()
    y = xf @ weight.float().t()
    return (y + bias.float() if bias is not None else y).to(x.dtype)


# ---- kernel -----------------------------------------------------------------------------------

@triton.jit
def _x_chunk_t(x_ptr, ms, m_mask, kk, stride_xm):
    """x^T for rows ms, inputs kk: [len(kk), BLOCK_M] in x's dtype (rows past M are zeros); loaded
    K-contiguous (vectorized) and transposed in registers."""
    return tl.trans(tl.load(x_ptr + ms[:, None] * stride_xm + kk[None, :], mask=m_mask[:, None], other=0.0))


@triton.jit
def _mma(a, b, acc, F32: tl.constexpr):
    """acc + a @ b on tensor cores; F32 (the CPU interpreter, which has no bf16 / fp8 dot): in fp32."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


def _dequant_ptx(groups: int) -> str:
    """Two int32 words in ($8, $9), then per group of the tile -(128 + z) and s as bf16 pairs; out
    the 8 nibble planes dequantized, (q - z) * s as bf16 pairs (low half: the first word). Per
    byte b of both words one PRMT gathers them; per plane a mask-and-OR puts q into a bf16
    mantissa under exponent 2^7 (128 + q), one packed FMA subtracts 128 + z (exact: small
    integers) and one multiplies by s (rounded once, as the reference's cast). ~2 instructions
    per weight, no converter."""
    lines = ["{ .reg .b32 x, y, t, one, nz;", "mov.b32 one, 0x3F803F80;", "mov.b32 nz, 0x80008000;"]
    for b, sel in enumerate(("0x4400", "0x5511", "0x6622", "0x7733")):
        lines.append(f"prmt.b32 x, $8, $9, {sel};")
        lines.append("shr.b32 y, x, 4;")
        for half, src in enumerate(("x", "y")):
            plane = 2 * b + half
            g = plane * groups // 8
            lines += [f"and.b32 t, {src}, 0x000F000F;", "or.b32 t, t, 0x43004300;",
                      f"fma.rn.bf16x2 t, t, one, ${10 + g};", f"fma.rn.bf16x2 ${plane}, t, ${10 + groups + g}, nz;"]
    return "\n".join(lines + ["}"])


def _constant(text: str):
    return tl.constexpr(text) if HAS_TRITON else text


_PTX_1, _PTX_2, _PTX_4 = (_constant(_dequant_ptx(g)) for g in (1, 2, 4))
_CONS_1, _CONS_2, _CONS_4 = (_constant(",".join(["=r"] * 8 + ["r"] * (2 + 2 * g))) for g in (1, 2, 4))


@triton.jit
def _group_operands(s_ptr, z_ptr, g, g_stride, cols, N, C: tl.constexpr):
    """-(128 + z) and s of group g for the tile's rows, broadcast to [BLOCK_N, C] bf16."""
    s = tl.load(s_ptr + g * g_stride + cols, mask=cols < N, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * g_stride + cols, mask=cols < N, other=0.0).to(tl.float32)
    nzz = tl.broadcast_to((-128.0 - z).to(tl.bfloat16)[:, None], [cols.shape[0], C])
    return nzz, tl.broadcast_to(s.to(tl.bfloat16)[:, None], [cols.shape[0], C])


@triton.jit
def _int4_tile_asm(acc, words, x_ptr, ms, m_mask, stride_xm, k0, s_ptr, z_ptr, g_stride, cols, N,
                   GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The CUDA path: dequantized bf16 planes by inline PTX (_dequant_ptx), then one chain of
    tensor-core products into acc [BLOCK_N, BLOCK_M] (no per-group epilogue)."""
    C: tl.constexpr = BLOCK_K // 8
    GPT: tl.constexpr = BLOCK_K // GROUP
    g0 = k0 // GROUP
    z0, s0 = _group_operands(s_ptr, z_ptr, g0, g_stride, cols, N, C)
    if GPT == 1:
        planes = tl.inline_asm_elementwise(_PTX_1, _CONS_1, [words, z0, s0], dtype=(tl.bfloat16,) * 8,
                                           is_pure=True, pack=2)
    elif GPT == 2:
        z1, s1 = _group_operands(s_ptr, z_ptr, g0 + 1, g_stride, cols, N, C)
        planes = tl.inline_asm_elementwise(_PTX_2, _CONS_2, [words, z0, z1, s0, s1],
                                           dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    else:
        z1, s1 = _group_operands(s_ptr, z_ptr, g0 + 1, g_stride, cols, N, C)
        z2, s2 = _group_operands(s_ptr, z_ptr, g0 + 2, g_stride, cols, N, C)
        z3, s3 = _group_operands(s_ptr, z_ptr, g0 + 3, g_stride, cols, N, C)
        planes = tl.inline_asm_elementwise(_PTX_4, _CONS_4, [words, z0, z1, z2, z3, s0, s1, s2, s3],
                                           dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    for i in tl.static_range(8):
        xc = _x_chunk_t(x_ptr, ms, m_mask, k0 + i * C + tl.arange(0, C), stride_xm)   # [C, BM]
        acc = tl.dot(planes[i], xc.to(tl.bfloat16), acc)
    return acc


@triton.jit
def _int4_tile(acc, words, x_ptr, ms, m_mask, stride_xm, k0, s_ptr, z_ptr, g_stride, cols, N,
               GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               DOT: tl.constexpr, F32: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] += dequant(words [BLOCK_N, BLOCK_K / 8]) @ x[:, k0:k0+BLOCK_K]^T.
    The weights are the MMA's A operand (wgmma takes it from registers, no shared-memory trip)."""
    C: tl.constexpr = BLOCK_K // 8
    PER_GROUP: tl.constexpr = GROUP // C           # chunks per group (the layout keeps a chunk in one)
    part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    xsum = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    ones = tl.full([BLOCK_N, C], 1.0, tl.float32).to(tl.bfloat16)
    for i in tl.static_range(8):
        xc = _x_chunk_t(x_ptr, ms, m_mask, k0 + i * C + tl.arange(0, C), stride_xm)   # [C, BM]
        q = (words >> (4 * i)) & 0xF                                                  # [BN, C]
        if DOT:   # bf16 128 + q: exponent 2^7 and q as the mantissa's low bits
            wq = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
            part = _mma(wq, xc.to(tl.bfloat16), part, F32)
            xsum = _mma(ones, xc.to(tl.bfloat16), xsum, F32)      # sum(x) per group, on the MMA too
        else:     # fp32 2^23 + q, minus 2^23: exact, no converter
            qf = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            part += tl.sum(qf[:, :, None] * xc.to(tl.float32)[None, :, :], axis=1)
            xsum += tl.sum(xc.to(tl.float32), axis=0)[None, :]
        if (i + 1) % PER_GROUP == 0:                    # the group ends: its scale and zero once
            g = (k0 + i * C) // GROUP
            s = tl.load(s_ptr + g * g_stride + cols, mask=cols < N, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g * g_stride + cols, mask=cols < N, other=0.0).to(tl.float32)
            zz = z + 128.0 if DOT else z
            acc += s[:, None] * (part - zz[:, None] * xsum)
            part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            xsum = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    return acc


@triton.jit
def _channel_tile(acc, w, x_ptr, ms, m_mask, stride_xm, k0, QUANT: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT: tl.constexpr, F32: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] += w [BLOCK_N, BLOCK_K] @ x[:, k0:k0+BLOCK_K]^T (unscaled codes)."""
    xc = _x_chunk_t(x_ptr, ms, m_mask, k0 + tl.arange(0, BLOCK_K), stride_xm)          # [BK, BM]
    if QUANT == 3:       # e4m3 activations, one scale per (row, block): the prologue's quantization
        xf = xc.to(tl.float32)
        sx = tl.maximum(tl.max(tl.abs(xf), axis=0) / 448.0, 1e-12)                      # [BM]
        xq = tl.clamp(xf / sx[None, :], -448.0, 448.0).to(tl.float8e4nv)
        acc += _mma(w, xq, tl.zeros_like(acc), F32) * sx[None, :]
    elif DOT:
        acc = _mma(w if F32 else w.to(tl.bfloat16), xc.to(tl.bfloat16), acc, F32)
    elif w.dtype == tl.int8:   # 2^23 + 128 + q, exact for q in [-128, 127]
        wf = (w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        acc += tl.sum(wf[:, :, None] * xc.to(tl.float32)[None, :, :], axis=1)
    else:
        acc += tl.sum(w.to(tl.float32)[:, :, None] * xc.to(tl.float32)[None, :, :], axis=1)
    return acc


@triton.jit
def _channel_fma1(acc_e, w, x_ptr, k0, BLOCK_K: tl.constexpr):
    """One row, CUDA cores: acc_e [BLOCK_N, BLOCK_K] += w * x elementwise (reduced once, after the loop)."""
    xr = tl.load(x_ptr + k0 + tl.arange(0, BLOCK_K)).to(tl.float32)[None, :]
    if w.dtype == tl.int8:     # 2^23 + 128 + q, exact for q in [-128, 127]
        wf = (w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
    else:
        wf = w.to(tl.float32)
    return acc_e + wf * xr


@triton.jit
def _load_w(w_ptrs, t, BLOCK_K: tl.constexpr, QUANT: tl.constexpr):
    step: tl.constexpr = BLOCK_K // 8 if QUANT == 2 else BLOCK_K
    return tl.load(w_ptrs + t * step, eviction_policy="evict_first")


@triton.jit(do_not_specialize=["M", "split_k"])     # one compile for every row count and split
def _splitk_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
                   M, N, K, stride_xm, stride_wn, g_stride, stride_ym, split_k,
                   QUANT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                   USE_PDL: tl.constexpr, F32: tl.constexpr, PREFETCH: tl.constexpr,
                   ASM: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    safe = tl.minimum(cols, N - 1).to(tl.int64)     # rows past N re-read row N-1 (stores masked)
    if QUANT == 2:
        w_ptrs = w_ptr + safe[:, None] * stride_wn + tl.arange(0, BLOCK_K // 8)[None, :]
    else:
        w_ptrs = w_ptr + safe[:, None] * stride_wn + tl.arange(0, BLOCK_K)[None, :]
    tiles = K // BLOCK_K
    per = tl.cdiv(tiles, split_k)       # split_k is a runtime value: one compile serves every split
    t0 = pid_k * per
    t1 = tl.minimum(t0 + per, tiles)
    # The weights never depend on the previous kernel: start streaming them before the wait.
    if PREFETCH:
        w = _load_w(w_ptrs, tl.minimum(t0, tiles - 1), BLOCK_K, QUANT)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    ms = tl.arange(0, BLOCK_M).to(tl.int64)
    m_mask = ms < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)                      # y^T
    ELEM: tl.constexpr = QUANT != 2 and not DOT and BLOCK_M == 1
    acc_e = tl.zeros([BLOCK_N, BLOCK_K] if ELEM else [1, 1], dtype=tl.float32)
    for t in range(t0, t1):
        if PREFETCH:
            w_next = _load_w(w_ptrs, tl.minimum(t + 1, t1 - 1), BLOCK_K, QUANT)   # one tile ahead in flight
        else:
            w = _load_w(w_ptrs, t, BLOCK_K, QUANT)
            w_next = w
        if QUANT == 2 and ASM:
            acc = _int4_tile_asm(acc, w, x_ptr, ms, m_mask, stride_xm, t * BLOCK_K, s_ptr, z_ptr, g_stride, cols, N,
                                 GROUP, BLOCK_K)
        elif QUANT == 2:
            acc = _int4_tile(acc, w, x_ptr, ms, m_mask, stride_xm, t * BLOCK_K, s_ptr, z_ptr, g_stride, cols, N,
                             GROUP, BLOCK_M, BLOCK_N, BLOCK_K, DOT, F32)
        elif ELEM:
            acc_e = _channel_fma1(acc_e, w, x_ptr, t * BLOCK_K, BLOCK_K)
        else:
            acc = _channel_tile(acc, w, x_ptr, ms, m_mask, stride_xm, t * BLOCK_K, QUANT, BLOCK_K, DOT, F32)
        w = w_next
    if ELEM:
        acc = tl.sum(acc_e, axis=1)[:, None]
    out_mask = (cols < N)[:, None] & m_mask[None, :]
    if SPLIT:           # partials to the workspace; the last program of this N tile reduces
        offs = ms[None, :] * N + cols[:, None]
        tl.store(ws_ptr + pid_k * M * N + offs, acc, mask=out_mask)
        tl.debug_barrier()          # every thread's partials are written before the release
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == split_k - 1:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for j in range(split_k):
                acc += tl.load(ws_ptr + j * M * N + offs, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(cnt_ptr + pid_n, 0)
            _epilogue(acc, s_ptr, b_ptr, y_ptr, ms, cols, out_mask, N, stride_ym, QUANT, HAS_BIAS)
    else:
        _epilogue(acc, s_ptr, b_ptr, y_ptr, ms, cols, out_mask, N, stride_ym, QUANT, HAS_BIAS)


@triton.jit
def _epilogue(acc, s_ptr, b_ptr, y_ptr, ms, cols, out_mask, N, stride_ym, QUANT: tl.constexpr,
              HAS_BIAS: tl.constexpr):
    if QUANT != 2:       # per-channel weight scale
        acc = acc * tl.load(s_ptr + cols, mask=cols < N, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + ms[None, :] * stride_ym + cols[:, None], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


# ---- launch -----------------------------------------------------------------------------------

MAX_ROWS = 16
_workspaces: dict[torch.device, torch.Tensor] = {}


def reserve_workspace(device: torch.device, n: int, split_k: int, rows: int = MAX_ROWS) -> torch.Tensor:
    """The fp32 partial-sum buffer, shared by every layer (they run one after another). Called at
    load (not inside graph capture) with each layer's largest need."""
    need = max(rows * n * split_k, 1)
    ws = _workspaces.get(device)
    if ws is None or ws.numel() < need:
        ws = _workspaces[device] = torch.empty(need, dtype=torch.float32, device=device)
    return ws


def new_counters(n: int, block_n_min: int = 16, device=None) -> torch.Tensor:
    """A layer's per-N-tile arrival counters (zeros; each reduction resets its own)."""
    return torch.zeros(triton.cdiv(n, block_n_min), dtype=torch.int32, device=device)


def check_config(quant: int, cfg: SplitKConfig, m: int, n: int, k: int, group: int) -> str | None:
    """Why `cfg` cannot run this shape, or None."""
    if m > MAX_ROWS:
        return f"{m} rows > {MAX_ROWS}"
    if not cfg.dot and m > 4:
        return "the FMA variant takes at most 4 rows"
    if quant == QUANT_FP8_A8 and not cfg.dot:
        return "W8A8 runs on tensor cores (dot=True) only"
    if k % cfg.block_k:
        return f"block_k {cfg.block_k} does not divide K = {k}"
    if quant == QUANT_INT4 and not (group <= cfg.block_k <= 8 * group and cfg.block_k % group == 0):
        return f"int4 block_k {cfg.block_k} must be a multiple of the group {group}, at most 8x it"
    if cfg.dot and (cfg.block_k // (8 if quant == QUANT_INT4 else 1) < 16 or cfg.block_n < 16):
        return "tensor-core tiles need block_k / 8 (int4) or block_k >= 16 and block_n >= 16"
    return None


def splitk_config(quant: int, m: int, n: int, k: int, group: int = 128, sms: int = 132) -> SplitKConfig:
    """Static tiles (graph-captured calls cannot autotune) for shapes the kernel table lacks:
    [64, 256] tensor-core tiles (int4: ~120 registers, ~2 instructions per weight in the offline
    SASS), and split-K for ~4 waves of programs over the SMs."""
    block_k = max(256, group) if quant == QUANT_INT4 else 256
    block_k = block_k if k % block_k == 0 else 128
    tiles_n, split = triton.cdiv(n, 64), 1
    while tiles_n * split < 4 * sms and split * 2 <= k // block_k and split < 16:
        split *= 2
    return SplitKConfig(64, block_k, split, dot=True)


def splitk_gemm(quant: int, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor | None = None, bias: torch.Tensor | None = None, group: int = 128,
                config: SplitKConfig | None = None, counters: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T. int4: qweight int32 [N, K/8] from repack_int4(block_k = config's),
    scales and zeros [K/G, N]; per-channel: qweight [N, K], scales fp32 [N]."""
    require_triton(x, qweight)
    x = x if x.stride(1) == 1 else x.contiguous()
    m, n = x.shape[0], qweight.shape[0]
    k = qweight.shape[1] * (8 if quant == QUANT_INT4 else 1)
    assert x.shape[1] == k, (tuple(x.shape), tuple(qweight.shape))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = config or splitk_config(quant, m, n, k, group)
    why = check_config(quant, cfg, m, n, k, group)
    assert why is None, why
    if cfg.split_k > 1:
        ws = reserve_workspace(x.device, n, cfg.split_k, m)
        counters = counters if counters is not None else new_counters(n, cfg.block_n, x.device)
        assert counters.numel() >= triton.cdiv(n, cfg.block_n)
    else:
        ws = counters = y
    pdl = use_pdl(x)
    _splitk_kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
        x, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else y, y, ws, counters,
        m, n, k, x.stride(0), qweight.stride(0), scales.stride(0) if scales.dim() == 2 else 0, y.stride(0),
        cfg.split_k,
        QUANT=quant, GROUP=group, HAS_BIAS=bias is not None, DOT=cfg.dot,
        BLOCK_M=max(16 if cfg.dot else 1, next_power_of_2(m)), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT=cfg.split_k > 1, USE_PDL=pdl, F32=not x.is_cuda, PREFETCH=cfg.stages == 1,
        ASM=cfg.asm and x.is_cuda and quant == QUANT_INT4 and cfg.dot and x.dtype == torch.bfloat16
        and cfg.block_k // group in (1, 2, 4), num_warps=cfg.num_warps,
        num_stages=cfg.stages, launch_pdl=pdl)
    return y


__all__ = ["MAX_ROWS", "QUANT_CHANNEL", "QUANT_FP8_A8", "QUANT_INT4", "SplitKConfig", "check_config",
           "new_counters", "quantize_act_blocks_ref", "repack_groups", "repack_int4", "reserve_workspace",
           "splitk_config", "splitk_gemm", "splitk_ref", "unrepack_int4"]
