"""Rotary position embedding (neox / HF half-rotation layout), applied in place to q and k.

In: q [T, Hq, D], k [T, Hkv, D] (last dim contiguous; views of a fused qkv output are fine),
positions [T] int, cos_sin_cache [max_pos, D] fp32 holding cos in [:, :D/2] and sin in
[:, D/2:] (built by `build_rope_cache`, which is where llama3 scaling lives).
Out: q and k rotated in place. Optionally the same launch also stores the rotated k and v into
the paged KV cache (saves a kernel per layer in decode, where launches dominate), and first
RMS-normalises each q and k head with its own weight (Qwen3's q_norm / k_norm: two launches a
layer fewer), rounding as the separate RMSNorm kernel does. With `delta` (a one-row step's LoRA
delta of the qkv projection, left by it: kernels/lora_delta.py) q, k and v are first the
projection's output plus its delta (v written back too), one program per KV head then, so each
holds only its heads' rows of B.
"""

import math

import torch

from ._triton import next_power_of_2, require_triton, tl, triton, use_pdl
from .kv_quant import is_fp8
from .kv_store import fp8_code
from .lora_delta import LoRADelta, add_delta_2d, delta_b_2d
from .rms_norm import rms_norm_ref


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency rescaling: slow down low frequencies, keep high ones, blend between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # smooth = 0 at the low-frequency edge (wavelen = old_len / low), 1 at the high edge
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rope_inv_freq(head_dim: int, base: float, rope_scaling: dict | None = None) -> torch.Tensor:
    """The D/2 rotary frequencies [D/2] (fp64), with llama3 rescaling applied when configured."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    if kind == "linear":
        return inv_freq / rope_scaling["factor"]
    if kind not in ("default", None):
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")
    return inv_freq


def build_rope_cache(head_dim: int, max_position: int, base: float = 10000.0,
                     rope_scaling: dict | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """cos_sin_cache [max_position, head_dim] fp32: cos(pos * f) | sin(pos * f) for D/2 freqs."""
    inv_freq = rope_inv_freq(head_dim, base, rope_scaling)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)   # [max_pos, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float().to(device)


def rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference (out of place): HF `q * cos + rotate_half(q) * sin`, in fp32."""
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]                     # [T, D]
    cos, sin = cs[:, None, :half], cs[:, None, half:]        # [T, 1, D/2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float()[..., :half], x.float()[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def head_norm_rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                         q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `apply_rotary(..., head_norms=...)`: rms_norm_ref over each head, then rotary_ref."""
    return rotary_ref(rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps), positions, cos_sin_cache)


@triton.jit
def _load_halves(ptr, stride_h, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr):
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HALF)
    mask = (h < NUM_HEADS)[:, None]
    p1 = ptr + h[:, None] * stride_h + d[None, :]            # [HEADS_PAD, HALF]
    return tl.load(p1, mask=mask, other=0.0), tl.load(p1 + HALF, mask=mask, other=0.0), p1, mask


@triton.jit
def _rotate_store(x1, x2, p1, mask, cos, sin, HALF: tl.constexpr):
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    y1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(p1.dtype.element_ty)
    y2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(p1.dtype.element_ty)
    tl.store(p1, y1, mask=mask)
    tl.store(p1 + HALF, y2, mask=mask)
    return y1, y2


@triton.jit
def _head_norm(x1, x2, w_ptr, eps, HALF: tl.constexpr):
    """Each head (row) of halves x1, x2 RMS-normalised and scaled by the head weight [2 * HALF], rounded
    to x's dtype twice as kernels/rms_norm.py does (after the normalisation, after the weight)."""
    d = tl.arange(0, HALF)
    w1 = tl.load(w_ptr + d).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    rstd = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF) + eps)
    n1 = (f1 * rstd[:, None]).to(x1.dtype).to(tl.float32) * w1[None, :]
    n2 = (f2 * rstd[:, None]).to(x2.dtype).to(tl.float32) * w2[None, :]
    return n1.to(x1.dtype), n2.to(x2.dtype)


@triton.jit
def _head_delta_b(head0, lb_ptr, li_ptr, stride_lb, col0, n, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                  RANK: tl.constexpr):
    """B rows of both halves of heads head0.. (their columns from col0 in the qkv output)."""
    cols = col0 + (head0 + tl.arange(0, HEADS_PAD))[:, None] * (2 * HALF) + tl.arange(0, HALF)[None, :]
    return delta_b_2d(cols, lb_ptr, li_ptr, stride_lb, n, RANK), delta_b_2d(cols + HALF, lb_ptr, li_ptr, stride_lb, n,
                                                                           RANK), cols


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cache_ptr,
    v_ptr, kv_ptr, slot_ptr, scale_ptr, qw_ptr, kw_ptr, eps,
    sh_ptr, lb_ptr, ls_ptr, li_ptr, stride_lb,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    stride_vt, stride_vh, stride_c_kv, stride_c_slot, stride_c_head,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_PAD: tl.constexpr, KV_PAD: tl.constexpr,
    HALF: tl.constexpr, STORE_KV: tl.constexpr, KV_FP8: tl.constexpr, HEAD_NORM: tl.constexpr,
    USE_PDL: tl.constexpr, HAS_DELTA: tl.constexpr, RANK: tl.constexpr, Q_TOTAL: tl.constexpr,
    KV_TOTAL: tl.constexpr,
):
    """Program (token, g): q heads g*NUM_Q_HEADS.. and kv heads g*NUM_KV_HEADS.. (g = 0: all of
    them, unless a LoRA delta splits the heads by KV head)."""
    qh0 = tl.program_id(1) * NUM_Q_HEADS
    kh0 = tl.program_id(1) * NUM_KV_HEADS
    if HAS_DELTA:    # B never depends on the kernels before: in flight while they drain
        q_size = Q_TOTAL * 2 * HALF
        kv_size = KV_TOTAL * 2 * HALF
        n = q_size + 2 * kv_size
        bq1, bq2, q_cols = _head_delta_b(qh0, lb_ptr, li_ptr, stride_lb, 0, n, Q_PAD, HALF, RANK)
        bk1, bk2, k_cols = _head_delta_b(kh0, lb_ptr, li_ptr, stride_lb, q_size, n, KV_PAD, HALF, RANK)
        bv1, bv2, v_cols = _head_delta_b(kh0, lb_ptr, li_ptr, stride_lb, q_size + kv_size, n, KV_PAD, HALF, RANK)
    if USE_PDL:  # programmatic dependent launch: wait for the producer, let the consumer launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    # independent loads first (q, k, position, slot), then the position-dependent cos/sin:
    # at decode sizes the kernel's time is its chain of memory round trips
    q1, q2, q_p, q_mask = _load_halves(q_ptr + token * stride_qt + qh0 * stride_qh, stride_qh, NUM_Q_HEADS, Q_PAD,
                                       HALF)
    k1, k2, k_p, k_mask = _load_halves(k_ptr + token * stride_kt + kh0 * stride_kh, stride_kh, NUM_KV_HEADS, KV_PAD,
                                       HALF)
    if STORE_KV:
        v1, v2, v_p, _ = _load_halves(v_ptr + token * stride_vt + kh0 * stride_vh, stride_vh, NUM_KV_HEADS, KV_PAD,
                                      HALF)
        slot = tl.load(slot_ptr + token).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    if HAS_DELTA:
        s1, s2 = Q_TOTAL * 2 * HALF, (Q_TOTAL + KV_TOTAL) * 2 * HALF
        q1 = add_delta_2d(q1, bq1, q_cols, sh_ptr, ls_ptr, li_ptr, RANK, s1, s2)
        q2 = add_delta_2d(q2, bq2, q_cols + HALF, sh_ptr, ls_ptr, li_ptr, RANK, s1, s2)
        k1 = add_delta_2d(k1, bk1, k_cols, sh_ptr, ls_ptr, li_ptr, RANK, s1, s2)
        k2 = add_delta_2d(k2, bk2, k_cols + HALF, sh_ptr, ls_ptr, li_ptr, RANK, s1, s2)
        v1 = add_delta_2d(v1, bv1, v_cols, sh_ptr, ls_ptr, li_ptr, RANK, s1, s2)
        v2 = add_delta_2d(v2, bv2, v_cols + HALF, sh_ptr, ls_ptr, li_ptr, RANK, s1, s2)
        tl.store(v_p, v1, mask=k_mask)          # the v tensor itself holds the projection's output
        tl.store(v_p + HALF, v2, mask=k_mask)
    if HEAD_NORM:
        q1, q2 = _head_norm(q1, q2, qw_ptr, eps, HALF)
        k1, k2 = _head_norm(k1, k2, kw_ptr, eps, HALF)
    d = tl.arange(0, HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + d)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + d)
    _rotate_store(q1, q2, q_p, q_mask, cos, sin, HALF)
    k1, k2 = _rotate_store(k1, k2, k_p, k_mask, cos, sin, HALF)
    if STORE_KV:
        if slot >= 0:
            _store_rotated(kv_ptr + slot * stride_c_slot + kh0 * stride_c_head, k1, k2, v1, v2, k_mask, scale_ptr,
                           stride_c_kv, stride_c_head, KV_PAD, HALF, KV_FP8)


@triton.jit
def _store_rotated(dst_ptr, k1, k2, v1, v2, mask, scale_ptr, stride_c_kv, stride_c_head,
                   KV_PAD: tl.constexpr, HALF: tl.constexpr, KV_FP8: tl.constexpr):
    """One token's rotated k (already rounded to k's dtype) and v, as halves, into its cache slot;
    e4m3 codes for an fp8 cache."""
    if KV_FP8:
        k_inv = tl.load(scale_ptr + 2)
        v_inv = tl.load(scale_ptr + 3)
        k1 = fp8_code(k1, k_inv)
        k2 = fp8_code(k2, k_inv)
        v1 = fp8_code(v1, v_inv)
        v2 = fp8_code(v2, v_inv)
    h = tl.arange(0, KV_PAD)
    d = tl.arange(0, HALF)
    dst = dst_ptr + h[:, None] * stride_c_head + d[None, :]
    tl.store(dst, k1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, k2.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv + HALF, v2.to(dst_ptr.dtype.element_ty), mask=mask)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 v: torch.Tensor | None = None, kv_cache: torch.Tensor | None = None,
                 slot_mapping: torch.Tensor | None = None, kv_scales: torch.Tensor | None = None,
                 head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                 delta: LoRADelta | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place; returns (q, k).

    With v, kv_cache and slot_mapping given, also stores the rotated k and v into the cache
    (same contract as `kv_store.store_kv`, kv_scales included for an fp8 cache), so attention
    can skip its own store. `head_norms` (q weight [D], k weight [D], eps): each head is
    RMS-normalised first (`head_norm_rotary_ref`). `delta`: the qkv projection's deferred LoRA
    delta for its one row (q, k, v views of that [1, (Hq + 2 Hkv) D] output, the cache given).
    """
    require_triton(q, k, cos_sin_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    assert cos_sin_cache.shape[-1] == head_dim and head_dim == next_power_of_2(head_dim)
    store = kv_cache is not None
    fp8 = store and is_fp8(kv_cache)
    if store:
        assert v is not None and slot_mapping is not None and kv_cache.is_contiguous()
        assert not fp8 or kv_scales is not None, "an fp8 KV cache needs its scales"
    else:
        v, kv_cache, slot_mapping = k, k, positions          # unused placeholders
    if not fp8:
        kv_scales = positions                                # unused placeholder
    if head_norms is not None:
        assert head_norms[0].shape == (head_dim,) and head_norms[1].shape == (head_dim,)
        assert head_norms[0].is_contiguous() and head_norms[1].is_contiguous()
    qw, kw, eps = head_norms if head_norms is not None else (positions, positions, 0.0)
    if num_tokens == 0:
        return q, k
    groups = 1
    if delta is not None:
        assert store and num_tokens == 1 and num_q_heads % num_kv_heads == 0, "a qkv row's delta, the cache given"
        assert sum(delta.slices) == (num_q_heads + 2 * num_kv_heads) * head_dim
        groups = num_kv_heads
    q_heads, kv_heads = num_q_heads // groups, num_kv_heads // groups
    args = delta.kernel_args() if delta is not None else (q, q, q, q, 0)
    _rotary_kernel[(num_tokens, groups)](
        q, k, positions, cos_sin_cache, v, kv_cache, slot_mapping, kv_scales, qw, kw, eps, *args,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        v.stride(0), v.stride(1),
        kv_cache.stride(0) if store else 0, kv_cache.stride(2) if store else 0,
        kv_cache.stride(3) if store else 0,
        NUM_Q_HEADS=q_heads, NUM_KV_HEADS=kv_heads, Q_PAD=next_power_of_2(q_heads),
        KV_PAD=next_power_of_2(kv_heads), HALF=head_dim // 2, STORE_KV=store, KV_FP8=fp8,
        HEAD_NORM=head_norms is not None, USE_PDL=use_pdl(q), HAS_DELTA=delta is not None,
        RANK=delta.lora_b.shape[2] if delta is not None else 16, Q_TOTAL=num_q_heads, KV_TOTAL=num_kv_heads,
        num_warps=4 if delta is None else 8, launch_pdl=use_pdl(q),
    )
    return q, k
