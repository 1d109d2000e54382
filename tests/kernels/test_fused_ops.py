"""Triton kv store, RMSNorm, rotary and SiLU-and-mul against their torch references."""

import pytest
import torch

from tokenforge.kernels.activation import silu_and_mul, silu_and_mul_ref
from tokenforge.kernels.kv_store import store_kv, store_kv_ref
from tokenforge.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from tokenforge.kernels.rotary import apply_rotary, build_rope_cache, head_norm_rotary_ref, rotary_ref

DTYPES = [torch.float32, torch.bfloat16]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def _qkv_views(t: int, hq: int, hkv: int, d: int, dtype, device):
    """q, k, v as strided views of one fused qkv projection output [T, (Hq + 2 Hkv) D]."""
    qkv = torch.randn(t, (hq + 2 * hkv) * d, dtype=dtype, device=device)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(8, 128), (3, 64)])
def test_store_kv_exact(device, dtype, num_kv_heads, head_dim):
    kv = torch.randn(2, 20, 16, num_kv_heads, head_dim, dtype=dtype, device=device)
    expect = kv.clone()
    _, k, v = _qkv_views(11, 4, num_kv_heads, head_dim, dtype, device)
    slots = torch.randperm(320)[:11].to(torch.int32)
    slots[[2, 7]] = -1                                          # padding tokens write nothing
    slots = slots.to(device)
    store_kv(k, v, kv, slots)
    store_kv_ref(k, v, expect, slots)
    assert torch.equal(kv, expect)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 4096), (37, 576)])
def test_rms_norm(device, rel_err, tol, dtype, tokens, hidden):
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    w = torch.randn(hidden, dtype=dtype, device=device)
    assert rel_err(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5)) <= tol(dtype)
    expect = rms_norm_ref(x, w, 1e-5)
    rms_norm(x, w, 1e-5, out=x)                                 # in place
    assert rel_err(x, expect) <= tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(3, 4096), (64, 576)])
def test_fused_add_rms_norm_in_place(device, rel_err, tol, dtype, tokens, hidden):
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    res = torch.randn(tokens, hidden, dtype=dtype, device=device)
    w = torch.randn(hidden, dtype=dtype, device=device)
    out_ref, res_ref = fused_add_rms_norm_ref(x, res, w, 1e-6)
    out, new_res = fused_add_rms_norm(x, res, w, 1e-6, out=x)
    assert out is x and new_res is res
    assert rel_err(out, out_ref) <= tol(dtype)
    if device.type == "cuda":                                   # same fp32 add, same rounding
        assert torch.equal(new_res, res_ref)
    assert rel_err(new_res, res_ref) <= tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,scaling", [(32, 8, 128, LLAMA3), (9, 3, 64, None)])
def test_rotary_in_place(device, rel_err, tol, dtype, hq, hkv, d, scaling):
    cache = build_rope_cache(d, 8192, 500000.0 if scaling else 10000.0, scaling, device=device)
    q, k, _ = _qkv_views(19, hq, hkv, d, dtype, device)
    pos = torch.randint(0, 8192, (19,), device=device)
    q_ref, k_ref = rotary_ref(q, k, pos, cache)
    apply_rotary(q, k, pos, cache)
    assert rel_err(q, q_ref) <= tol(dtype) and rel_err(k, k_ref) <= tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_fused_kv_store(device, rel_err, tol, dtype):
    cache = build_rope_cache(128, 4096, 500000.0, LLAMA3, device=device)
    q, k, v = _qkv_views(9, 32, 8, 128, dtype, device)
    pos = torch.randint(0, 4096, (9,), device=device)
    slots = torch.tensor([0, 5, -1, 63, 17, 18, 40, -1, 2], dtype=torch.int32, device=device)
    kv = torch.randn(2, 4, 16, 8, 128, dtype=dtype, device=device)
    expect = kv.clone()
    q_ref, k_ref = rotary_ref(q, k, pos, cache)
    store_kv_ref(k_ref, v, expect, slots)
    apply_rotary(q, k, pos, cache, v=v, kv_cache=kv, slot_mapping=slots)
    assert rel_err(q, q_ref) <= tol(dtype) and rel_err(k, k_ref) <= tol(dtype)
    assert rel_err(kv, expect) <= tol(dtype)
    stored = kv.flatten(1, 2)[0, slots[slots >= 0].long()]
    assert torch.equal(stored, k[slots >= 0])                   # the cache holds the rotated k itself


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,store", [(32, 4, 128, True), (5, 1, 64, False)])
def test_rotary_with_head_norms(device, rel_err, tol, dtype, hq, hkv, d, store):
    """Qwen3's per-head q_norm / k_norm in the rotary launch: the separate RMSNorm then rotary
    (their references), the cache holding the normed, rotated k; heads of very different scales
    (the norm is per head, not per token)."""
    cache = build_rope_cache(d, 4096, 1000000.0, None, device=device)
    q, k, v = _qkv_views(7, hq, hkv, d, dtype, device)
    q.mul_(torch.logspace(-2, 2, hq, device=device).to(dtype)[None, :, None])
    qw, kw = (1 + 0.3 * torch.randn(d, device=device)).to(dtype), (1 + 0.3 * torch.randn(d, device=device)).to(dtype)
    pos = torch.randint(0, 4096, (7,), device=device)
    q_ref, k_ref = head_norm_rotary_ref(q, k, pos, cache, qw, kw, 1e-6)
    kv = torch.zeros(2, 4, 16, hkv, d, dtype=dtype, device=device) if store else None
    slots = torch.tensor([0, 5, -1, 63, 17, 18, 40], dtype=torch.int32, device=device) if store else None
    apply_rotary(q, k, pos, cache, v=v if store else None, kv_cache=kv, slot_mapping=slots, head_norms=(qw, kw, 1e-6))
    assert rel_err(q, q_ref) <= tol(dtype) and rel_err(k, k_ref) <= tol(dtype)
    assert rel_err(q[:, 0], q_ref[:, 0]) <= tol(dtype)       # the smallest head normed on its own
    if store:
        assert torch.equal(kv.flatten(1, 2)[0, slots[slots >= 0].long()], k[slots >= 0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 14336), (33, 1500)])
def test_silu_and_mul(device, rel_err, tol, dtype, tokens, inter):
    x = torch.randn(tokens, 2 * inter, dtype=dtype, device=device)
    assert rel_err(silu_and_mul(x), silu_and_mul_ref(x)) <= tol(dtype)
