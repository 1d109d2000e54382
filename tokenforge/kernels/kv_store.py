"""Store new keys and values into the paged KV cache.

In: k, v [T, Hkv, D] (last dim contiguous; other strides free, so views of a fused qkv output
work), kv_cache [2, num_blocks, block_size, Hkv, D], slot_mapping [T] (flat slot
`block * block_size + offset`; -1 marks padding, which writes nothing).
Out: nothing; kv_cache is written in place.
"""

import torch

from ._triton import next_power_of_2, require_triton, tl, triton, use_pdl


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Torch reference: index_copy the valid tokens into the flattened cache."""
    valid = slot_mapping >= 0                                  # [T]
    slots = slot_mapping[valid].long()
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])  # [2, NB*BS, Hkv, D]
    flat[0].index_copy_(0, slots, k[valid].to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v[valid].to(kv_cache.dtype))


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv, stride_c_slot, stride_c_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, USE_PDL: tl.constexpr,
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
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    src_v = h[:, None] * stride_vh + d[None, :]
    v = tl.load(v_ptr + token * stride_vt + src_v, mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k/v [T, Hkv, D] into kv_cache at slot_mapping [T]; one program per token."""
    require_triton(k, v, kv_cache)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and kv_cache.is_contiguous()
    assert head_dim == next_power_of_2(head_dim), "head_dim must be a power of two"
    _store_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEADS_PAD=next_power_of_2(num_heads), USE_PDL=use_pdl(k),
        num_warps=4 if num_heads * head_dim >= 1024 else 2, launch_pdl=use_pdl(k),
    )
