"""Attention sinks (gpt-oss: one value-less logit per head in each softmax) in the Triton kernels
against the torch reference: varlen prefill (fresh prompts, prefix hits, chunks), split-KV decode
(one split, several, a padding row), with and without a sliding window; then a tiny gpt-oss on the
triton backend against the torch backend. GPU (or TRITON_INTERPRET=1 on the CPU, small shapes)."""

import os

import pytest
import torch

from tokenforge.kernels.paged_attention import decode_attention, paged_attention_ref, prefill_attention

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1" and not torch.cuda.is_available()


def _dtype():
    return torch.float32 if INTERPRET else torch.bfloat16      # the interpreter does not emulate bf16 dots


def _scale(n: int) -> int:
    return max(1, n // 8) if INTERPRET else n


def _sinks(hq, device):
    return (torch.randn(hq, generator=torch.Generator().manual_seed(hq)) * 2 + 1).to(device)


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_with_sinks(device, paged_problem, rel_err, tol, window):
    torch.manual_seed(0)
    ctx, qlens = [0, _scale(37), 0, _scale(130)], [_scale(200), 1, 3, _scale(77)]
    q, kv, tables, qsl, seq_lens, _ = paged_problem(ctx, qlens, 8, 2, 64, 16, _dtype(), device)
    sinks = _sinks(8, device)
    out = prefill_attention(q, kv, tables, qsl, seq_lens, 0.125, max_query_len=max(qlens), sliding_window=window,
                            sinks=sinks)
    ref = paged_attention_ref(q, kv, tables, qsl, seq_lens, 0.125, sliding_window=window, sinks=sinks)
    assert rel_err(out, ref) <= tol(_dtype())
    plain = paged_attention_ref(q, kv, tables, qsl, seq_lens, 0.125, sliding_window=window)
    assert rel_err(plain, ref) > 10 * tol(_dtype())            # the sinks really moved the output


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("num_splits", [1, 7])
def test_decode_with_sinks(device, paged_problem, rel_err, tol, window, num_splits):
    torch.manual_seed(1)
    ctx = [_scale(3000), 0, 16, _scale(700)]
    q, kv, tables, _, seq_lens, _ = paged_problem(ctx, [1] * len(ctx), 8, 2, 64, 16, _dtype(), device)
    seq_lens[1] = 0                                             # padding row -> zeros
    sinks = _sinks(8, device)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, kv, tables, seq_lens, 0.125, num_splits=num_splits, out=out, sliding_window=window,
                     sinks=sinks)
    qsl = torch.arange(len(ctx) + 1, dtype=torch.int32, device=device)
    ref = paged_attention_ref(q, kv, tables, qsl, seq_lens, 0.125, sliding_window=window, sinks=sinks)
    assert rel_err(out, ref) <= tol(_dtype())
    assert out[1].abs().max() == 0


def test_gpt_oss_on_triton_matches_torch_backend(device, rel_err, tmp_path):
    """The triton backend (kernels with sinks, the fused rotary + store) against the torch backend
    on a tiny gpt-oss: chunked prefill past the window, then batched decode."""
    from tests.model import moe_checkpoints
    from tests.model.conftest import PagedDriver
    from tokenforge.model.attention.triton_backend import TritonAttentionBackend
    from tokenforge.model.loader import load_model

    _, path = moe_checkpoints.gpt_oss(tmp_path)
    outs = {}
    for name, backend in (("torch", None), ("triton", TritonAttentionBackend())):
        model = load_model(str(path), "auto", torch.float32, device).model
        driver = PagedDriver(model, block_size=4, backend=backend)
        first = driver.step([("a", list(range(3, 20))), ("b", list(range(40, 49)))])
        second = driver.step([("a", list(range(20, 31))), ("b", [7])])
        third = driver.step([("a", [9]), ("b", [11])])
        outs[name] = torch.cat([*first, *second, *third])
    assert rel_err(outs["triton"], outs["torch"]) < 1e-4
