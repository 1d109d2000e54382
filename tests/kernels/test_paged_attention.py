"""Triton paged attention (prefill and split-KV decode) against the torch reference."""

import os

import pytest
import torch

from tokenforge.kernels.paged_attention import decode_attention, paged_attention_ref, prefill_attention

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1" and not torch.cuda.is_available()

# (num_q_heads, num_kv_heads, head_dim, block_size, dtype): GQA 1, 4, 7, 8; D 64/128; bs 16/32
CASES = [
    (2, 2, 128, 16, torch.bfloat16),
    (8, 2, 128, 16, torch.bfloat16),
    (16, 2, 64, 32, torch.bfloat16),
    (14, 2, 128, 32, torch.bfloat16),
    (8, 2, 64, 16, torch.float32),
    (16, 2, 128, 32, torch.float32),
    (2, 2, 64, 32, torch.float32),
]


def _skip_interpreted_bf16(device, dtype):
    if device.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter does not emulate bf16 dots")


def _scale(n: int) -> int:
    return max(1, n // 8) if INTERPRET else n     # the interpreter is ~1000x slower


@pytest.mark.parametrize("hq,hkv,d,bs,dtype", CASES)
def test_prefill_with_prefix_and_chunks(device, paged_problem, rel_err, tol, hq, hkv, d, bs, dtype):
    """Fresh prompts, prefix-cache hits (context > 0), chunks and query_len-1 rows in one batch."""
    _skip_interpreted_bf16(device, dtype)
    torch.manual_seed(hq * d + bs)
    ctx = [0, _scale(37), _scale(130), 0, 5, _scale(300)]
    qlens = [_scale(200), 1, _scale(77), 3, _scale(16), 1]
    q, kv, tables, qsl, seq_lens, _ = paged_problem(ctx, qlens, hq, hkv, d, bs, dtype, device)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, kv, tables, qsl, seq_lens, d ** -0.5, max_query_len=max(qlens), out=out)
    ref = paged_attention_ref(q, kv, tables, qsl, seq_lens, d ** -0.5)
    assert rel_err(out, ref) <= tol(dtype)


def test_prefill_single_long_sequence(device, paged_problem, rel_err, tol):
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    q, kv, tables, qsl, seq_lens, _ = paged_problem([0], [_scale(1500)], 32, 8, 128, 16, dtype, device)
    out = prefill_attention(q, kv, tables, qsl, seq_lens, 0.088)
    assert rel_err(out, paged_attention_ref(q, kv, tables, qsl, seq_lens, 0.088)) <= tol(dtype)


DECODE_VARIANTS = [
    {},                                                          # heuristic split count
    {"num_splits": 1},                                           # one program per group, no reduce
    {"num_splits": 7},
    {"num_splits": 64, "block_n": 32},                           # more splits than some sequences have tiles
]


@pytest.mark.parametrize("hq,hkv,d,bs,dtype", CASES)
@pytest.mark.parametrize("variant", DECODE_VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) or "default")
def test_decode_split_kv(device, paged_problem, rel_err, tol, hq, hkv, d, bs, dtype, variant):
    """Long contexts (several splits), short ones (empty splits exit) and a padding row."""
    _skip_interpreted_bf16(device, dtype)
    torch.manual_seed(hq + d + bs)
    ctx = [_scale(3000), 0, 16, _scale(700), 62]
    q, kv, tables, _, seq_lens, _ = paged_problem(ctx, [1] * len(ctx), hq, hkv, d, bs, dtype, device)
    seq_lens[1] = 0                                             # padding row -> zeros
    out = torch.full_like(q, float("nan"))
    decode_attention(q, kv, tables, seq_lens, d ** -0.5, out=out, **variant)
    qsl = torch.arange(len(ctx) + 1, dtype=torch.int32, device=device)
    ref = paged_attention_ref(q, kv, tables, qsl, seq_lens, d ** -0.5)
    assert rel_err(out, ref) <= tol(dtype)
    assert out[1].abs().max() == 0


@pytest.mark.parametrize("block_n", [32, 128])
def test_decode_tile_sizes(device, paged_problem, rel_err, tol, block_n):
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    q, kv, tables, _, seq_lens, _ = paged_problem([_scale(1000), 5], [1, 1], 32, 8, 128, 16, dtype, device)
    out = decode_attention(q, kv, tables, seq_lens, 0.088, num_splits=4, block_n=block_n)
    qsl = torch.arange(3, dtype=torch.int32, device=device)
    assert rel_err(out, paged_attention_ref(q, kv, tables, qsl, seq_lens, 0.088)) <= tol(dtype)


def test_decode_equals_prefill_on_decode_rows(device, paged_problem, rel_err):
    """The two kernels agree on the same one-query rows (mixed batches use the prefill kernel)."""
    dtype = torch.float32
    q, kv, tables, qsl, seq_lens, _ = paged_problem([_scale(500), 9, 130], [1, 1, 1], 8, 2, 64, 16, dtype, device)
    a = decode_attention(q, kv, tables, seq_lens, 0.125, num_splits=3)
    b = prefill_attention(q, kv, tables, qsl, seq_lens, 0.125)
    assert rel_err(a, b) <= 1e-5
