"""Elementwise kernels of the quantized linears at large M: weight dequantization and fp8
activation quantization.

- `dequantize_int4` / `dequantize_channel`: packed weight -> [N, K] in the model dtype, one read
  and one write. At large M a quantized linear dequantizes into a temporary and runs cuBLAS: the
  GEMM's FLOPs dominate there (M = 512 at N, K = 4096: the dequant costs ~2% of the matmul).
- `per_token_quant_fp8`: x [M, K] -> (e4m3 [M, K], fp32 scale [M, 1]) with amax / 448 per row
  (dynamic) or a given per-tensor scale (static), the activation side of fp8 W8A8;
  `rms_norm_quant_fp8` / `silu_mul_quant_fp8` fuse it into the kernel that produces the
  activation (the residual add + RMSNorm, the SwiGLU), so W8A8's many-row path reads the
  activation once and writes e4m3: no separate quantization pass. Numerics: the produced
  activation is rounded to the model dtype first, exactly as the unfused chain rounds it.
Each has a torch reference (`*_ref`) with the same rounding.
"""

from __future__ import annotations

import torch

from ._triton import next_power_of_2, require_triton, tl, triton, use_pdl
from .quant_gemv import dequantize_channel_ref, dequantize_int4_ref

FP8_MAX = 448.0                     # largest finite float8_e4m3fn
_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # an all-zero row quantizes to zeros, not NaN


def per_token_quant_fp8_ref(x: torch.Tensor, static_scale: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    if static_scale is None:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE)
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_x, stride_q, min_scale,
                            STATIC: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, min_scale)
    q = tl.clamp(x / scale, -448.0, 448.0)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def per_token_quant_fp8(x: torch.Tensor, static_scale: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], fp32 scale [M, 1]); one program per row."""
    require_triton(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        pdl = use_pdl(x)
        _per_token_quant_kernel[(m,)](
            x, q, scale, static_scale if static_scale is not None else scale, k, x.stride(0), q.stride(0),
            _MIN_SCALE, STATIC=static_scale is not None, BLOCK=next_power_of_2(k), USE_PDL=pdl,
            num_warps=8 if k >= 8192 else 4, launch_pdl=pdl)
    return q, scale


def rms_norm_quant_fp8_ref(x, residual, weight, eps, static_scale=None):
    from .rms_norm import fused_add_rms_norm_ref, rms_norm_ref  # noqa: PLC0415

    if residual is None:
        h, new_residual = rms_norm_ref(x, weight, eps), x
    else:
        h, new_residual = fused_add_rms_norm_ref(x, residual, weight, eps)
    return (*per_token_quant_fp8_ref(h, static_scale), new_residual)


def silu_mul_quant_fp8_ref(gate_up, static_scale=None):
    from .activation import silu_and_mul_ref  # noqa: PLC0415

    return per_token_quant_fp8_ref(silu_and_mul_ref(gate_up), static_scale)


@triton.jit
def _produce_quant_kernel(x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, static_ptr, K, stride_x, stride_r, stride_q, eps,
                          min_scale, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STATIC: tl.constexpr,
                          BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """One row: h = rmsnorm(x (+ residual)) * w (PROLOGUE 1; the sum written back to the
    residual) or silu(gate) * up (PROLOGUE 2), rounded to x's dtype, then e4m3 codes and the scale."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    dt = x_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if PROLOGUE == 2:
        g = x.to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + K + cols, mask=mask, other=0.0).to(tl.float32)
        h = (g * tl.sigmoid(g) * u).to(dt).to(tl.float32)
    else:
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
            tl.store(r_ptr + row * stride_r + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        h = ((xf * rstd).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        scale = tl.maximum(tl.max(tl.abs(h), axis=0) / 448.0, min_scale)
    q = tl.clamp(h / scale, -448.0, 448.0)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def _produce_quant(prologue: int, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                   eps: float, static_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    require_triton(x)
    assert x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    m = x.shape[0]
    k = x.shape[1] // 2 if prologue == 2 else x.shape[1]
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        pdl = use_pdl(x)
        r = residual if residual is not None else x
        _produce_quant_kernel[(m,)](
            x, r, weight if weight is not None else x, q, scale, static_scale if static_scale is not None else scale,
            k, x.stride(0), r.stride(0), q.stride(0), eps, _MIN_SCALE, PROLOGUE=prologue,
            HAS_RESIDUAL=residual is not None, STATIC=static_scale is not None, BLOCK=next_power_of_2(k),
            # the norm kernel's warps: the same layout, so the same reduction order (bit-equal rstd)
            USE_PDL=pdl, num_warps=max(1, min(16, next_power_of_2(k) // 256)), launch_pdl=pdl)
    return q, scale


def rms_norm_quant_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       static_scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], fp32 scale [M, 1], the residual) of rmsnorm(x + residual) * weight; the
    residual is updated in place to x + residual (with None, x is the residual)."""
    q, scale = _produce_quant(1, x, residual, weight, eps, static_scale)
    return q, scale, residual if residual is not None else x


def silu_mul_quant_fp8(gate_up: torch.Tensor, static_scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, I], fp32 scale [M, 1]) of silu(gate) * up for gate_up [M, 2I]."""
    return _produce_quant(2, gate_up, None, None, 0.0, static_scale)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_w, stride_g, stride_o,
                    QUANT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    TILE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rmask = (rows < N)[:, None]
    rows64 = rows.to(tl.int64)[:, None]
    if QUANT == 4:      # quant_splitk's tile layout: words [N, K/8], scales and zeros [K/G, N]
        c: tl.constexpr = TILE // 8
        word = cols // TILE * c + cols % c
        shift = (cols % TILE) // c * 4
        p = tl.load(w_ptr + rows64 * stride_w + word[None, :], mask=rmask & (cols < K)[None, :], other=0)
        q = ((p >> shift[None, :]) & 0xF).to(tl.float32)
        gmask = rmask & (cols < K)[None, :]
        g = (cols // GROUP).to(tl.int64)[None, :] * stride_g + rows64
        w = (q - tl.load(z_ptr + g, mask=gmask, other=0.0).to(tl.float32)) * tl.load(s_ptr + g, mask=gmask, other=0.0).to(tl.float32)
    elif QUANT == 2:
        half = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        p = tl.load(w_ptr + rows64 * stride_w + half[None, :], mask=rmask & (half < K // 2)[None, :], other=0)
        q = tl.reshape(tl.join(p & 0xF, p >> 4), [BLOCK_N, BLOCK_K]).to(tl.float32)
        g = cols // GROUP
        gmask = rmask & (cols < K)[None, :]
        s = tl.load(s_ptr + rows64 * stride_g + g[None, :], mask=gmask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rows64 * stride_g + g[None, :], mask=gmask, other=0.0).to(tl.float32)
        w = (q - z) * s
    else:
        w = tl.load(w_ptr + rows64 * stride_w + cols[None, :], mask=rmask & (cols < K)[None, :], other=0.0)
        w = w.to(tl.float32) * tl.load(s_ptr + rows, mask=rows < N, other=0.0)[:, None]
    tl.store(out_ptr + rows64 * stride_o + cols[None, :], w.to(out_ptr.dtype.element_ty),
             mask=rmask & (cols < K)[None, :])


def _dequant(quant: int, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
             k: int, dtype: torch.dtype, group: int, tile: int = 8) -> torch.Tensor:
    require_triton(qweight)
    n = qweight.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    block_n, block_k = 16, 256
    _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight, scales, zeros if zeros is not None else scales, out, n, k, qweight.stride(0),
        scales.stride(0) if scales.dim() == 2 else 0, out.stride(0),
        QUANT=quant, GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k, TILE=tile, num_warps=4)
    return out


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype,
                    group: int) -> torch.Tensor:
    """uint8 [N, K/2], scales and zeros [N, K/G] -> [N, K] in dtype."""
    return _dequant(2, packed, scales, zeros, packed.shape[1] * 2, dtype, group)


def dequantize_int4_tiles(words: torch.Tensor, scales_t: torch.Tensor, zeros_t: torch.Tensor, dtype: torch.dtype,
                          group: int, tile: int) -> torch.Tensor:
    """quant_splitk's layout: int32 [N, K/8] (tile of `tile` inputs), scales and zeros [K/G, N] -> [N, K]."""
    return _dequant(4, words, scales_t, zeros_t, words.shape[1] * 8, dtype, group, tile)


def dequantize_channel(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 / fp8 [N, K], fp32 scale [N] -> [N, K] in dtype."""
    return _dequant(1, qweight, scale, None, qweight.shape[1], dtype, 1)


__all__ = ["FP8_MAX", "dequantize_channel", "dequantize_channel_ref", "dequantize_int4", "dequantize_int4_ref",
           "dequantize_int4_tiles", "rms_norm_quant_fp8", "rms_norm_quant_fp8_ref", "silu_mul_quant_fp8",
           "silu_mul_quant_fp8_ref",
           "per_token_quant_fp8", "per_token_quant_fp8_ref"]
