"""GEMV for decode-sized batches: y = prologue(x) @ W^T, W [N, K] row-major (K contiguous).

In: x [M, K] (M = 1 is the fast case: faster than cuBLAS on an H200; any M is correct, but M >= 2
is slower than cuBLAS), W [N, K], optional bias [N].
Out: y [M, N] in x's dtype, accumulated in fp32. Three prologues, computed on the fly from the
small, L2-resident activations:
- `gemv`: x itself (o_proj, lm_head);
- `add_rms_norm_gemv`: s = x + residual (written to a new tensor by exactly one program per row
  block), h = rmsnorm(s) * norm_weight; every program recomputes its rows' norm (8 KB at K = 4096)
  instead of paying a separate norm launch (norm + qkv_proj, norm + gate_up_proj);
- `silu_mul_gemv`: a = silu(gate) * up from gu [M, 2K] = [gate | up] (SwiGLU + down_proj).
Intermediates are rounded to the model dtype where the unfused path rounds them.

Why not cuBLAS at M = 1: the weights are the only real traffic and never depend on the previous
kernel. With programmatic dependent launch each program issues its first weight tile *before*
griddepcontrol.wait, so weight streaming overlaps the previous kernel's tail and this kernel's
launch, which a cuBLAS call inside a CUDA graph cannot do. No split-K: with 2-8 rows per program
even N = 4096 gives 1024 programs (~8 per SM), enough loads in flight without a reduction pass;
the main loop keeps the next weight tile in flight while it multiplies the current one.
Measurements and the configs tried: bench/NOTES.md, "Small-M GEMVs".
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._triton import next_power_of_2, require_triton, tl, triton, use_pdl
from .activation import silu_and_mul_ref
from .rms_norm import fused_add_rms_norm_ref, rms_norm_ref

PLAIN, NORM, SILU_MUL = 0, 1, 2


class GemvConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1


# ---- torch references -------------------------------------------------------------------------

def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ weight.float().t()
    return (y + bias.float() if bias is not None else y).to(x.dtype)


def add_rms_norm_gemv_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                          weight: torch.Tensor, bias: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is None:
        h, residual = rms_norm_ref(x, norm_weight, eps), x
    else:
        h, residual = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
    return gemv_ref(h, weight, bias), residual


def silu_mul_gemv_ref(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return gemv_ref(silu_and_mul_ref(gate_up), weight, bias)


# ---- kernel -----------------------------------------------------------------------------------

@triton.jit
def _x_chunk(x_ptr, r_ptr, nw_ptr, ms, m_mask, kk, K, stride_xm, stride_rm, rstd,
             PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The GEMV input for rows ms and columns kk: [BLOCK_M, BLOCK_K] in fp32."""
    dt = x_ptr.dtype.element_ty
    mask = m_mask[:, None] & (kk < K)[None, :]
    offs = ms[:, None] * stride_xm + kk[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if PROLOGUE == 2:    # SiLU-and-mul: x is [gate | up], each K wide
        g = x.to(tl.float32)
        u = tl.load(x_ptr + offs + K, mask=mask, other=0.0).to(tl.float32)
        out = (g * tl.sigmoid(g) * u).to(dt).to(tl.float32)
    elif PROLOGUE == 1:  # (residual add +) RMSNorm, rounded like the standalone norm kernel
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + ms[:, None] * stride_rm + kk[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        nw = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        h = (x.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32) * nw[None, :]
        out = h.to(dt).to(tl.float32)
    else:
        out = x.to(tl.float32)
    return out


@triton.jit
def _row_rstd(x_ptr, r_ptr, s_ptr, ms, m_mask, K, stride_xm, stride_rm, stride_sm, eps, write_sum,
              HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, NORM_BLOCK: tl.constexpr):
    """1 / rms of each row of s = x (+ residual); the program with write_sum stores s. [BLOCK_M] fp32."""
    dt = x_ptr.dtype.element_ty
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, NORM_BLOCK):
        kk = k0 + tl.arange(0, NORM_BLOCK)
        mask = m_mask[:, None] & (kk < K)[None, :]
        s = tl.load(x_ptr + ms[:, None] * stride_xm + kk[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + ms[:, None] * stride_rm + kk[None, :], mask=mask, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(dt)
            tl.store(s_ptr + ms[:, None] * stride_sm + kk[None, :], s, mask=mask & write_sum)
        sf = s.to(tl.float32)
        sumsq += tl.sum(sf * sf, axis=1)
    return tl.rsqrt(sumsq / K + eps)


@triton.jit
def _fma(acc, w, xk, BLOCK_M: tl.constexpr):
    if BLOCK_M == 1:    # acc [BLOCK_N, BLOCK_K]: no 3-D broadcast at batch 1
        acc += w.to(tl.float32) * xk
    else:               # acc [BLOCK_M, BLOCK_N, BLOCK_K]
        acc += w.to(tl.float32)[None, :, :] * xk[:, None, :]
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, s_ptr,
    M, N, K, stride_xm, stride_rm, stride_sm, stride_wn, stride_ym, eps,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr,
    EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Rows past N re-read row N-1 (stores are masked): unmasked rows keep the loads vectorised.
    w_ptrs = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn + ks[None, :]
    # The weights never depend on the previous kernel: start streaming them before the wait.
    if EVEN_K:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs, mask=(ks < K)[None, :], other=0.0, eviction_policy="evict_first")
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    ms = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_mask = ms < M
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 1:
        rstd = _row_rstd(x_ptr, r_ptr, s_ptr, ms, m_mask, K, stride_xm, stride_rm, stride_sm, eps,
                         pid_n == 0, HAS_RESIDUAL, BLOCK_M, NORM_BLOCK)
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        # issue tile k0 before multiplying tile k0 - BLOCK_K: two tiles in flight per program
        if EVEN_K:
            w_next = tl.load(w_ptrs + k0, eviction_policy="evict_first")
        else:
            w_next = tl.load(w_ptrs + k0, mask=(k0 + ks < K)[None, :], other=0.0, eviction_policy="evict_first")
        xk = _x_chunk(x_ptr, r_ptr, nw_ptr, ms, m_mask, k0 - BLOCK_K + ks, K, stride_xm, stride_rm, rstd,
                      PROLOGUE, HAS_RESIDUAL)
        acc = _fma(acc, w, xk, BLOCK_M)
        w = w_next
    last = (K - 1) // BLOCK_K * BLOCK_K
    xk = _x_chunk(x_ptr, r_ptr, nw_ptr, ms, m_mask, last + ks, K, stride_xm, stride_rm, rstd,
                  PROLOGUE, HAS_RESIDUAL)
    acc = _fma(acc, w, xk, BLOCK_M)
    if BLOCK_M == 1:
        y = tl.sum(acc, axis=1)[None, :]                            # [1, BLOCK_N]
    else:
        y = tl.sum(acc, axis=2)                                     # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[None, :]
    mask = m_mask[:, None] & (rows < N)[None, :]
    tl.store(y_ptr + ms[:, None] * stride_ym + rows[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


# ---- launch -----------------------------------------------------------------------------------

def gemv_config(m: int, n: int, k: int) -> GemvConfig:
    """Static block sizes (no autotuning: these calls are captured in CUDA graphs).

    M = 1 entries are the fastest of a 10-config sweep on an H200 (bench/NOTES.md): [4, 512]
    tiles for N = 4096 (o_proj, down_proj: 1024 programs), [8, 1024] for qkv (768 programs, one
    wave), [2, 1024] for the wide gate_up and lm_head. For M > 1 the K tile shrinks so the fp32
    accumulator stays at ~32 registers per thread (correct, but slower than cuBLAS there).
    """
    if m == 1:
        if n <= 4096:
            return GemvConfig(1, 4, 512)
        return GemvConfig(1, 8, 1024) if n <= 8192 else GemvConfig(1, 2, 1024)
    block_m = min(4, next_power_of_2(m))
    return GemvConfig(block_m, 4 if n <= 8192 else 8, max(128, min(1024 // block_m, next_power_of_2(k))))


def fuses_prologue(n: int, k: int) -> bool:
    """Whether fusing the norm / SiLU prologue into an [n, k] GEMV beats a separate launch.

    Every program re-reads the activations from L2 in the main loop; on the large shapes that
    costs more than the ~1 us launch it saves (H200, M = 1: gate_up fused 62.0 us vs norm + GEMV
    59.3 us; down 32.5 vs 30.6 us; qkv 15.8 vs 15.6 us, but one launch fewer in the graph).
    """
    return n * k <= 2**25


def _launch(prologue: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            config: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    require_triton(x, weight)
    assert x.dim() == 2 and weight.dim() == 2 and weight.stride(1) == 1
    x = x if x.stride(1) == 1 else x.contiguous()
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    assert x.shape[1] == (2 * k if prologue == SILU_MUL else k), (tuple(x.shape), tuple(weight.shape))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(x) if residual is not None else None
    if m == 0:
        return y, new_residual
    cfg = config or gemv_config(m, n, k)
    if residual is not None:
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
    r = residual if residual is not None else x
    s = new_residual if new_residual is not None else x
    pdl = use_pdl(x)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    _gemv_kernel[grid](
        x, r, norm_weight if norm_weight is not None else weight, weight, bias if bias is not None else weight,
        y, s, m, n, k, x.stride(0), r.stride(0), s.stride(0), weight.stride(0), y.stride(0), eps,
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        NORM_BLOCK=min(next_power_of_2(k), max(cfg.block_k, 8192 // cfg.block_m)),
        EVEN_K=k % cfg.block_k == 0, USE_PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    return y, new_residual


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) -> [M, N]."""
    return _launch(PLAIN, x, weight, bias, config=config)[0]


def add_rms_norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None = None, config: GemvConfig | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * norm_weight) @ weight^T (+ bias) -> (y [M, N], x + residual [M, K]).

    With residual None the norm applies to x and x itself is returned as the residual. The new
    residual is a new tensor: every program reads the old one, so it cannot be updated in place.
    """
    y, new_residual = _launch(NORM, x, weight, bias, residual, norm_weight, eps, config)
    return y, (new_residual if new_residual is not None else x)


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: GemvConfig | None = None) -> torch.Tensor:
    """(silu(gate) * up) @ weight^T (+ bias) for gate_up [M, 2K] = [gate | up], weight [N, K]."""
    return _launch(SILU_MUL, gate_up, weight, bias, config=config)[0]
