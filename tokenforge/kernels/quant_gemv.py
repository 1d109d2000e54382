"""Dequant-fused GEMVs for weight-only quantized linears: y = prologue(x) @ dequant(W)^T.

The same family as gemv.py (same prologues: plain, add + RMSNorm, SiLU-and-mul; same PDL weight
prefetch), with the weight stored in fewer bytes and dequantized in registers:
- per-channel (`QUANT_CHANNEL`): W is int8 or float8_e4m3fn [N, K], one fp32 scale per output
  row; y = (sum_k w[n,k] x[k]) * scale[n], so the scale costs one multiply per output;
- int4 asymmetric groups (`QUANT_INT4`): W is uint8 [N, K/2], two 4-bit values per byte (low
  nibble = even k), with a scale and an integer zero point per (row, group of G inputs) in the
  model dtype: w = (q - z) * s. Per group the kernel sums q * x and applies s * (qx - z * sum x),
  so the zero point and scale cost two FMAs per group, not per weight.

In: x [M, K] (M small: one program row per token), the packed weight, scales (and zeros), an
optional bias [N]. Out: y [M, N] in x's dtype, accumulated in fp32.
Each kernel has a torch reference below (dequantize, then the gemv.py reference).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._triton import next_power_of_2, require_triton, tl, triton, use_pdl
from .gemv import NORM, PLAIN, SILU_MUL, _row_rstd, _x_chunk, gemv_ref
from .activation import silu_and_mul_ref
from .rms_norm import fused_add_rms_norm_ref, rms_norm_ref

QUANT_CHANNEL, QUANT_INT4 = 1, 2


class QGemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int = 4
    magic: bool = True      # integer -> float by exponent bits (ALU) instead of the converter unit
    int4_split: bool = False  # int4: even/odd inputs per nibble (round 2) instead of interleaving (round 1)


# ---- torch references -------------------------------------------------------------------------

def dequantize_channel_ref(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 / fp8 [N, K] with fp32 scale [N] -> [N, K] in dtype."""
    return (qweight.float() * scale.float()[:, None]).to(dtype)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 [N, K] (low nibble first)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values in [0, 15], [N, K] (K even) -> uint8 [N, K/2] (low nibble = even k)."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def dequantize_int4_ref(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """packed uint8 [N, K/2], scales and zeros [N, K/G] -> [N, K] in dtype: (q - z) * s."""
    q = unpack_int4(packed).float()
    group = q.shape[1] // scales.shape[1]
    s = scales.float().repeat_interleave(group, dim=1)
    z = zeros.float().repeat_interleave(group, dim=1)
    return ((q - z) * s).to(dtype)


def qgemv_ref(prologue: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
              eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference for any prologue, given the dequantized weight [N, K]."""
    if prologue == SILU_MUL:
        return gemv_ref(silu_and_mul_ref(x), weight, bias), None
    if prologue == NORM:
        if residual is None:
            h, residual = rms_norm_ref(x, norm_weight, eps), x
        else:
            h, residual = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
        return gemv_ref(h, weight, bias), residual
    return gemv_ref(x, weight, bias), None


# ---- kernel -----------------------------------------------------------------------------------

@triton.jit
def _load_tile(w_ptrs, s_ptrs, z_ptrs, k0, rows_ok, K,
               QUANT: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The weight tile starting at input column k0 (packed), with its group scales and zeros."""
    if QUANT == 2:
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        kg = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        if EVEN_K:
            w = tl.load(w_ptrs + k0 // 2, eviction_policy="evict_first")
            s = tl.load(s_ptrs + k0 // GROUP)
            z = tl.load(z_ptrs + k0 // GROUP)
        else:
            w = tl.load(w_ptrs + k0 // 2, mask=(kb < K // 2)[None, :], other=0, eviction_policy="evict_first")
            s = tl.load(s_ptrs + k0 // GROUP, mask=(kg < K // GROUP)[None, :], other=0.0)
            z = tl.load(z_ptrs + k0 // GROUP, mask=(kg < K // GROUP)[None, :], other=0.0)
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs + k0, mask=(ks < K)[None, :], other=0.0, eviction_policy="evict_first")
        s = tl.zeros([1, 1], dtype=tl.float32)
        z = s
    return w, s, z


@triton.jit
def _int4_to_float(q, MAGIC: tl.constexpr):
    """int32 values in [0, 15] -> fp32. MAGIC: 2^23 + q has q's bits as its mantissa, so an OR and
    a subtraction replace the (quarter-rate) int -> float converter."""
    if MAGIC:
        return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return q.to(tl.float32)


@triton.jit
def _qfma(acc, w, s, z, xk, xo, QUANT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, MAGIC: tl.constexpr, SPLIT: tl.constexpr):
    """Accumulate one tile. Per-channel: xk [1, BLOCK_K] fp32, acc [BLOCK_N, BLOCK_K] += w * x.
    int4, acc [BLOCK_N, BLOCK_K / GROUP] += s * (sum_g q * x - z * sum_g x), two ways:
    - SPLIT: xk / xo [1, BLOCK_K / 2] are the even / odd inputs (the low / high nibbles, no
      interleaving shuffle, but strided input loads);
    - else xk [1, BLOCK_K] and the nibbles are interleaved back into input order (join + reshape).
    H200 (kernels_quant, 2026-12-01): SPLIT ran at 0.4 TB/s, interleaving at 0.9 (round 1)."""
    if QUANT == 2:
        b = w.to(tl.int32)
        if SPLIT:
            prod = _int4_to_float(b & 0xF, MAGIC) * xk + _int4_to_float(b >> 4, MAGIC) * xo     # [BN, BK/2]
            qx = tl.sum(tl.reshape(prod, [BLOCK_N, BLOCK_K // GROUP, GROUP // 2]), axis=2)
            xs = tl.sum(tl.reshape(xk + xo, [BLOCK_K // GROUP, GROUP // 2]), axis=1)          # [BK / G]
        else:
            q = tl.reshape(tl.join(_int4_to_float(b & 0xF, MAGIC), _int4_to_float(b >> 4, MAGIC)),
                           [BLOCK_N, BLOCK_K])                                                 # input order
            qx = tl.sum(tl.reshape(q * xk, [BLOCK_N, BLOCK_K // GROUP, GROUP]), axis=2)
            xs = tl.sum(tl.reshape(xk, [BLOCK_K // GROUP, GROUP]), axis=1)                    # [BK / G]
        acc += s.to(tl.float32) * (qx - z.to(tl.float32) * xs[None, :])
    elif MAGIC and w.dtype == tl.int8:   # 2^23 + 128 + q, exact for q in [-128, 127]
        acc += ((w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0) * xk
    else:
        acc += w.to(tl.float32) * xk
    return acc


@triton.jit
def _x_tile(x_ptr, r_ptr, nw_ptr, ms, m_mask, k0, K, stride_xm, stride_rm, rstd,
            PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, BLOCK_K: tl.constexpr,
            SPLIT: tl.constexpr):
    """The inputs of the tile at k0: all BLOCK_K, or (int4 SPLIT) its even and odd halves."""
    if QUANT == 2 and SPLIT:
        kk = k0 + 2 * tl.arange(0, BLOCK_K // 2)
        xe = _x_chunk(x_ptr, r_ptr, nw_ptr, ms, m_mask, kk, K, stride_xm, stride_rm, rstd, PROLOGUE, HAS_RESIDUAL)
        xo = _x_chunk(x_ptr, r_ptr, nw_ptr, ms, m_mask, kk + 1, K, stride_xm, stride_rm, rstd, PROLOGUE,
                      HAS_RESIDUAL)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        xe = _x_chunk(x_ptr, r_ptr, nw_ptr, ms, m_mask, kk, K, stride_xm, stride_rm, rstd, PROLOGUE, HAS_RESIDUAL)
        xo = xe
    return xe, xo


@triton.jit
def _qgemv_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, sc_ptr, zp_ptr, b_ptr, y_ptr, s_ptr,
    M, N, K, stride_xm, stride_rm, stride_sm, stride_wn, stride_gn, stride_ym, eps,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    QUANT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr,
    EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, MAGIC: tl.constexpr, SPLIT: tl.constexpr,
):
    # grid (M, N blocks): the M programs of one weight tile run back to back, so rows after the
    # first read it from L2
    pid_n = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    safe = tl.minimum(rows, N - 1).to(tl.int64)      # rows past N re-read row N-1 (stores masked)
    rows_ok = rows < N
    if QUANT == 2:
        w_ptrs = w_ptr + safe[:, None] * stride_wn + tl.arange(0, BLOCK_K // 2)[None, :]
        s_ptrs = sc_ptr + safe[:, None] * stride_gn + tl.arange(0, BLOCK_K // GROUP)[None, :]
        z_ptrs = zp_ptr + safe[:, None] * stride_gn + tl.arange(0, BLOCK_K // GROUP)[None, :]
    else:
        w_ptrs = w_ptr + safe[:, None] * stride_wn + tl.arange(0, BLOCK_K)[None, :]
        s_ptrs = sc_ptr
        z_ptrs = sc_ptr
    # The weights never depend on the previous kernel: start streaming them before the wait.
    w, s, z = _load_tile(w_ptrs, s_ptrs, z_ptrs, 0, rows_ok, K, QUANT, GROUP, BLOCK_K, EVEN_K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    ms = (tl.program_id(0) + tl.arange(0, 1)).to(tl.int64)
    m_mask = ms < M
    rstd = tl.zeros([1], dtype=tl.float32)
    if PROLOGUE == 1:
        rstd = _row_rstd(x_ptr, r_ptr, s_ptr, ms, m_mask, K, stride_xm, stride_rm, stride_sm, eps,
                         pid_n == 0, HAS_RESIDUAL, 1, NORM_BLOCK)
    if QUANT == 2:
        acc = tl.zeros([BLOCK_N, BLOCK_K // GROUP], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        # issue tile k0 before multiplying tile k0 - BLOCK_K: two tiles in flight per program
        w_next, s_next, z_next = _load_tile(w_ptrs, s_ptrs, z_ptrs, k0, rows_ok, K, QUANT, GROUP, BLOCK_K, EVEN_K)
        xe, xo = _x_tile(x_ptr, r_ptr, nw_ptr, ms, m_mask, k0 - BLOCK_K, K, stride_xm, stride_rm, rstd,
                         PROLOGUE, HAS_RESIDUAL, QUANT, BLOCK_K, SPLIT)
        acc = _qfma(acc, w, s, z, xe, xo, QUANT, GROUP, BLOCK_N, BLOCK_K, MAGIC, SPLIT)
        w, s, z = w_next, s_next, z_next
    last = (K - 1) // BLOCK_K * BLOCK_K
    xe, xo = _x_tile(x_ptr, r_ptr, nw_ptr, ms, m_mask, last, K, stride_xm, stride_rm, rstd,
                     PROLOGUE, HAS_RESIDUAL, QUANT, BLOCK_K, SPLIT)
    acc = _qfma(acc, w, s, z, xe, xo, QUANT, GROUP, BLOCK_N, BLOCK_K, MAGIC, SPLIT)
    y = tl.sum(acc, axis=1)                                          # [BLOCK_N]
    if QUANT == 1:
        y = y * tl.load(sc_ptr + rows, mask=rows_ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rows_ok, other=0.0).to(tl.float32)
    ym = tl.program_id(0).to(tl.int64)
    tl.store(y_ptr + ym * stride_ym + rows, y.to(y_ptr.dtype.element_ty), mask=rows_ok & (ym < M))


# ---- launch -----------------------------------------------------------------------------------

def qgemv_config(quant: int, n: int, k: int, group: int = 128) -> QGemvConfig:
    """Static tiles (graph-captured calls cannot autotune). Each tile re-reads its activations
    from L2: eight (int8) or eight to sixteen (int4) weight rows per program keep that re-read at a
    quarter of the weight bytes or less, as the bf16 GEMV's [4, 512] tiles do. H200, round 1:
    [2-4, 1024-2048] tiles with the converter unit ran at 1.5-2.0 TB/s (int8), 0.9 (int4); round 2
    (2026-12-01): [8, 512] int8 1.7-2.0 TB/s, the split int4 0.4 TB/s, so int4 is back to round 1's
    interleaving and tiles. `bench kernels_quant` sweeps the alternatives."""
    if quant == QUANT_INT4:
        return QGemvConfig(4 if n <= 8192 else 8, max(group, min(1024, next_power_of_2(k))))
    return QGemvConfig(8, min(512, next_power_of_2(k)))


def qgemv(prologue: int, quant: int, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
          zeros: torch.Tensor | None = None, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
          norm_weight: torch.Tensor | None = None, eps: float = 0.0, group: int = 128,
          config: QGemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One dequant-fused GEMV; returns (y [M, N], the new residual for NORM with a residual)."""
    require_triton(x, qweight)
    x = x if x.stride(1) == 1 else x.contiguous()
    m, n = x.shape[0], qweight.shape[0]
    k = qweight.shape[1] * (2 if quant == QUANT_INT4 else 1)
    assert x.shape[1] == (2 * k if prologue == SILU_MUL else k), (tuple(x.shape), tuple(qweight.shape))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(x) if residual is not None else None
    if m == 0:
        return y, new_residual
    cfg = config or qgemv_config(quant, n, k, group)
    if quant == QUANT_INT4:
        assert k % group == 0 and cfg.block_k % group == 0 and scales.shape == (n, k // group)
    if residual is not None:
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
    r = residual if residual is not None else x
    s = new_residual if new_residual is not None else x
    pdl = use_pdl(x)
    _qgemv_kernel[(m, triton.cdiv(n, cfg.block_n))](
        x, r, norm_weight if norm_weight is not None else x, qweight, scales,
        zeros if zeros is not None else scales, bias if bias is not None else x, y, s,
        m, n, k, x.stride(0), r.stride(0), s.stride(0), qweight.stride(0), scales.stride(0), y.stride(0), eps,
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        QUANT=quant, GROUP=group, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        NORM_BLOCK=min(next_power_of_2(k), max(cfg.block_k, 8192)),
        EVEN_K=k % cfg.block_k == 0, USE_PDL=pdl, MAGIC=cfg.magic, SPLIT=cfg.int4_split, num_warps=cfg.num_warps, num_stages=1, launch_pdl=pdl,
    )
    return y, new_residual


__all__ = ["NORM", "PLAIN", "QUANT_CHANNEL", "QUANT_INT4", "SILU_MUL", "QGemvConfig", "dequantize_channel_ref",
           "dequantize_int4_ref", "pack_int4", "qgemv", "qgemv_config", "qgemv_ref", "unpack_int4"]
