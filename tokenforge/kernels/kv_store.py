"""Store new keys and values into the paged KV cache.

In: k, v [T, Hkv, D] (last dim contiguous; other strides free, so views of a fused qkv output
work), kv_cache [2, num_blocks, block_size, Hkv, D], slot_mapping [T] (flat slot
`block * block_size + offset`; -1 marks padding, which writes nothing). An fp8 (e4m3) cache
also takes the layer's scales [4] (kv_quant.py) and stores quantized codes.
Out: nothing; kv_cache is written in place.
"""

import torch

from ._triton import next_power_of_2, require_triton, tl, triton, use_pdl
from .kv_quant import is_fp8, store_fp8


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scales: torch.Tensor | None = None) -> None:
    """Torch reference: index_copy the valid tokens into the flattened cache."""
    valid = slot_mapping >= 0                                  # [T]
    slots = slot_mapping[valid].long()
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])  # [2, NB*BS, Hkv, D]
    if is_fp8(kv_cache):
        store_fp8(flat, slots, k[valid], v[valid], kv_scales)
        return
    flat[0].index_copy_(0, slots, k[valid].to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v[valid].to(kv_cache.dtype))


@triton.jit
def fp8_code(x, inv_scale):
    """x / scale clamped to the e4m3 range, in fp32; the store's cast rounds it to nearest even.
    (448 = kv_quant.FP8_MAX; Triton kernels may not read Python globals.)"""
    return tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -448.0), 448.0)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv, stride_c_slot, stride_c_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, KV_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # programmatic dependent launch: wait for the producer, let the consumer launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM)
    mask = (h < NUM_HEADS)[:, None]
    src = h[:, None] * stride_kh + d[None, :]
    dst = cache_ptr + slot * stride_c_slot + h[:, None] * stride_c_head + d[None, :]
    k = tl.load(k_ptr + token * stride_kt + src, mask=mask)
    src_v = h[:, None] * stride_vh + d[None, :]
    v = tl.load(v_ptr + token * stride_vt + src_v, mask=mask)
    if KV_FP8:
        k = fp8_code(k, tl.load(scale_ptr + 2))
        v = fp8_code(v, tl.load(scale_ptr + 3))
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scales: torch.Tensor | None = None) -> None:
    """Write k/v [T, Hkv, D] into kv_cache at slot_mapping [T]; one program per token.
    An fp8 cache needs the layer's kv_scales [4]."""
    require_triton(k, v, kv_cache)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and kv_cache.is_contiguous()
    assert head_dim == next_power_of_2(head_dim), "head_dim must be a power of two"
    fp8 = is_fp8(kv_cache)
    assert not fp8 or kv_scales is not None, "an fp8 KV cache needs its scales"
    _store_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping, kv_scales if fp8 else slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEADS_PAD=next_power_of_2(num_heads), KV_FP8=fp8,
        USE_PDL=use_pdl(k),
        num_warps=4 if num_heads * head_dim >= 1024 else 2, launch_pdl=use_pdl(k),
    )
