"""FP8 (e4m3) KV cache kernels against the torch reference (kernels/kv_quant.py).

Stores: the Triton stores and the reference compute the same fp32 product x * (1/scale) and round
it to nearest even, so codes must agree bit for bit; a few codes may differ by one e4m3 step where
the hardware and torch break a tie differently, never more. Attention: the kernels read codes
and apply the scales folded into the softmax scale and the output, while the reference
dequantizes first; both see identical values, so the only difference is the kernels' bf16 dot
rounding, and the usual bf16 tolerance (1e-2 relative) applies.
"""

import pytest
import torch

from tokenforge.kernels.kv_quant import FP8_DTYPE, make_scales, quantize
from tokenforge.kernels.kv_store import store_kv, store_kv_ref
from tokenforge.kernels.paged_attention import decode_attention, paged_attention_ref, prefill_attention
from tokenforge.kernels.rotary import apply_rotary, build_rope_cache, rotary_ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                 reason="needs a CUDA GPU with FP8 (sm89+)")]


def _assert_codes_match(out: torch.Tensor, ref: torch.Tensor) -> None:
    a, b = out.view(torch.uint8), ref.view(torch.uint8)
    mismatched = (a != b).float().mean().item()
    assert mismatched <= 1e-3, f"{mismatched:.2%} of the e4m3 codes differ from the reference"
    va, vb = out.float(), ref.float()
    step = vb.abs().clamp_min(2.0 ** -9) / 8             # one e4m3 step (3 mantissa bits)
    assert ((va - vb).abs() <= step * 1.01).all(), "a code differs by more than one e4m3 step"


def _fp8_problem(paged_problem, ctx, qlens, hq, hkv, d, bs, seed):
    torch.manual_seed(seed)
    q, kv, tables, qsl, seq_lens, _ = paged_problem(ctx, qlens, hq, hkv, d, bs, torch.bfloat16, torch.device("cuda"))
    kv = kv * torch.tensor([4.0, 0.5], device="cuda").view(2, 1, 1, 1, 1).to(kv.dtype)   # K and V ranges differ
    scales = make_scales(kv[0].abs().max().item() / 200, kv[1].abs().max().item() / 200, "cuda")
    codes = torch.stack([quantize(kv[0], scales[2]), quantize(kv[1], scales[3])])
    return q, codes, tables, qsl, seq_lens, scales


def test_store_kv_fp8_matches_reference():
    torch.manual_seed(0)
    k = torch.randn(300, 8, 128, device="cuda", dtype=torch.bfloat16) * 7
    v = torch.randn(300, 8, 128, device="cuda", dtype=torch.bfloat16)
    k[3, 2, 5] = 1e4                                    # saturates to +448 in both
    slots = torch.randperm(64 * 16, device="cuda")[:300].int()
    slots[7] = -1                                       # padding: nothing written
    scales = make_scales(0.05, 0.01, "cuda")
    out = torch.zeros(2, 64, 16, 8, 128, dtype=FP8_DTYPE, device="cuda")
    ref = torch.zeros_like(out)
    store_kv(k, v, out, slots, scales)
    store_kv_ref(k, v, ref, slots.long(), scales)
    _assert_codes_match(out, ref)
    assert out.float().abs().max().item() == 448.0


def test_rotary_fused_store_fp8_matches_reference():
    torch.manual_seed(1)
    q = torch.randn(50, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(50, 8, 128, device="cuda", dtype=torch.bfloat16) * 3
    v = torch.randn(50, 8, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 4000, (50,), device="cuda")
    cos_sin = build_rope_cache(128, 4096, 500000.0, device="cuda")
    slots = torch.randperm(32 * 16, device="cuda")[:50].int()
    scales = make_scales(0.02, 0.01, "cuda")
    qr, kr = rotary_ref(q, k, pos, cos_sin)
    ref = torch.zeros(2, 32, 16, 8, 128, dtype=FP8_DTYPE, device="cuda")
    store_kv_ref(kr, v, ref, slots.long(), scales)
    out = torch.zeros_like(ref)
    apply_rotary(q, k, pos, cos_sin, v=v, kv_cache=out, slot_mapping=slots, kv_scales=scales)
    _assert_codes_match(out, ref)


@pytest.mark.parametrize("hq,hkv,d,bs", [(32, 8, 128, 16), (14, 2, 64, 32)])
@pytest.mark.parametrize("num_splits", [None, 1])
def test_decode_fp8_matches_reference(paged_problem, rel_err, hq, hkv, d, bs, num_splits):
    ctx = [3000, 16, 700, 62]
    q, codes, tables, _, seq_lens, scales = _fp8_problem(paged_problem, ctx, [1] * 4, hq, hkv, d, bs, hq + d)
    out = decode_attention(q, codes, tables, seq_lens, d ** -0.5, num_splits=num_splits, kv_scales=scales)
    qsl = torch.arange(len(ctx) + 1, dtype=torch.int32, device="cuda")
    ref = paged_attention_ref(q, codes, tables, qsl, seq_lens, d ** -0.5, kv_scales=scales)
    assert rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize("hq,hkv,d,bs", [(32, 8, 128, 16), (14, 2, 64, 32)])
def test_prefill_fp8_matches_reference(paged_problem, rel_err, hq, hkv, d, bs):
    ctx, qlens = [0, 37, 300, 5], [200, 1, 77, 16]
    q, codes, tables, qsl, seq_lens, scales = _fp8_problem(paged_problem, ctx, qlens, hq, hkv, d, bs, hq * d)
    out = prefill_attention(q, codes, tables, qsl, seq_lens, d ** -0.5, max_query_len=max(qlens), kv_scales=scales)
    ref = paged_attention_ref(q, codes, tables, qsl, seq_lens, d ** -0.5, kv_scales=scales)
    assert rel_err(out, ref) <= 1e-2


def test_fp8_cache_without_scales_is_refused(paged_problem):
    q, codes, tables, _, seq_lens, _ = _fp8_problem(paged_problem, [10], [1], 8, 2, 64, 16, 0)
    with pytest.raises(AssertionError, match="needs its scales"):
        decode_attention(q, codes, tables, seq_lens, 0.125)
