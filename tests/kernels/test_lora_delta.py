"""A one-row LoRA delta left by the GEMV for the kernel after (kernels/lora_delta.py): the norm after
o_proj and the SwiGLU after gate_up add it as they load their input, and give what the separate
expand launch followed by the plain kernel gives: against the torch reference, against that launch
pair, for a row without an adapter (nothing added), N off the block multiples and a new slot
written into the same index tensor (a replayed graph). GPU, or Triton's interpreter on the CPU
(float32 only); Llama-3.1-8B's o_proj and gate_up shapes on the GPU only. The layers that defer:
tests/executor/test_gpu_lora.py runs them in the engine's graphs against the reference path."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import INTERPRET, _rel_err, _tol
from tokenforge.kernels.activation import silu_and_mul, silu_and_mul_ref
from tokenforge.kernels.gemv import PLAIN
from tokenforge.kernels.gemv_lora import GemvLoRA, add_lora_delta, gemv_lora, gemv_lora_deferred
from tokenforge.kernels.lora_delta import lora_delta_ref
from tokenforge.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref


def _problem(slices, k, slot, dtype, device, seed=0, slots=3, rank=16):
    g = torch.Generator().manual_seed(seed)
    n = sum(slices)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype).to(device)
    lora = GemvLoRA((torch.randn(slots, len(slices) * rank, k, generator=g) * k ** -0.5).to(dtype).to(device),
                    (torch.randn(slots, n, rank, generator=g) * 0.5).to(dtype).to(device),
                    (torch.rand(slots, generator=g) + 0.5).to(device), torch.tensor([slot], device=device),
                    tuple(slices))
    x = torch.randn(1, k, generator=g).to(dtype).to(device)
    return w, lora, x


def _dtypes():
    return [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]


def _norm_case(slices, k, slot, dtype, device, with_residual):
    w, lora, x = _problem(slices, k, slot, dtype, device)
    n = sum(slices)
    nw = (1 + 0.2 * torch.randn(n, generator=torch.Generator().manual_seed(5))).to(dtype).to(device)
    res0 = torch.randn(1, n, generator=torch.Generator().manual_seed(6)).to(dtype).to(device)
    y, _, delta = gemv_lora_deferred(PLAIN, x, w, None, lora)
    assert _rel_err(lora_delta_ref(y, delta), gemv_lora(x, w, None, lora)) <= _tol(dtype)
    eager = gemv_lora(x, w, None, lora)                       # GEMV + the expand launch
    if with_residual:
        res = res0.clone()
        out, res = fused_add_rms_norm(y, res, nw, 1e-5, delta=delta)
        ref, ref_res = fused_add_rms_norm_ref(eager, res0, nw, 1e-5)
        assert _rel_err(res, ref_res) <= _tol(dtype)
    else:
        out, ref = rms_norm(y, nw, 1e-5, delta=delta), rms_norm_ref(eager, nw, 1e-5)
    return out, ref


@pytest.mark.parametrize("slot", [1, -1])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "alone"])
def test_norm_adds_the_deferred_delta(device, slot, with_residual):
    for dtype in _dtypes():
        out, ref = _norm_case((98,), 600, slot, dtype, device, with_residual)     # N not a power of two
        assert _rel_err(out, ref) <= _tol(dtype) * 2


@pytest.mark.parametrize("slot", [2, -1])
def test_silu_and_mul_adds_the_deferred_delta(device, slot):
    for dtype in _dtypes():
        w, lora, x = _problem((600, 600), 256, slot, dtype, device)
        y, _, delta = gemv_lora_deferred(PLAIN, x, w, None, lora)
        out = silu_and_mul(y, delta=delta)
        assert _rel_err(out, silu_and_mul_ref(gemv_lora(x, w, None, lora))) <= _tol(dtype) * 2
        assert _rel_err(out, silu_and_mul_ref(lora_delta_ref(y, delta))) <= _tol(dtype) * 2


def test_the_delta_follows_the_index_and_the_expand_agrees(device):
    """Slots 0 and 2 differ and -1 is the bare norm, written into one index tensor; the expand launch
    (for consumers that cannot add the delta) gives the reference's y."""
    w, lora, x = _problem((128,), 256, 0, torch.float32, device)
    nw = torch.ones(128, device=device)
    outs = []
    for slot in (0, 2, -1):
        lora.indices.fill_(slot)
        y, _, delta = gemv_lora_deferred(PLAIN, x, w, None, lora)
        ref_y = lora_delta_ref(y.clone(), delta)
        outs.append(rms_norm(y, nw, 1e-5, delta=delta))
        assert _rel_err(outs[-1], rms_norm_ref(ref_y, nw, 1e-5)) <= 1e-3
        assert _rel_err(add_lora_delta(y, delta), ref_y) <= 1e-4
    assert _rel_err(outs[2], rms_norm_ref(x @ w.t(), nw, 1e-5)) <= 1e-3
    assert (outs[0] - outs[1]).abs().max() > 1e-2 and (outs[0] - outs[2]).abs().max() > 1e-2


@pytest.mark.skipif(INTERPRET, reason="full-size shapes are too slow for the interpreter")
def test_llama_shapes(device):
    """o_proj (4096 x 4096) into the post-attention norm, gate_up (28672 x 4096) into the SwiGLU."""
    out, ref = _norm_case((4096,), 4096, 1, torch.bfloat16, device, with_residual=True)
    assert _rel_err(out, ref) <= _tol(torch.bfloat16) * 2
    w, lora, x = _problem((14336, 14336), 4096, 1, torch.bfloat16, device)
    y, _, delta = gemv_lora_deferred(PLAIN, x, w, None, lora)
    assert _rel_err(silu_and_mul(y, delta=delta), silu_and_mul_ref(gemv_lora(x, w, None, lora))) <= _tol(torch.bfloat16) * 2


@pytest.mark.parametrize("head_norms", [False, True], ids=["llama", "qwen3"])
@pytest.mark.parametrize("slot", [1, -1])
def test_rotary_adds_the_qkv_delta(device, head_norms, slot):
    """qkv's deferred delta in the rotary + cache-store launch (one program per KV head): q and k
    rotated, v and the cache as the expand launch then the plain rotary kernel leave them."""
    from tokenforge.kernels.rotary import apply_rotary, build_rope_cache     # noqa: PLC0415

    hq, hkv, d, block = 4, 2, 32, 16
    slices = (hq * d, hkv * d, hkv * d)
    w, lora, x = _problem(slices, 96, slot, torch.float32, device)
    cache = build_rope_cache(d, 64, device=device)
    pos, slots = torch.tensor([37], device=device), torch.tensor([21], device=device)
    g = torch.Generator().manual_seed(9)
    norms = (torch.rand(d, generator=g).to(device) + 0.5, torch.rand(d, generator=g).to(device) + 0.5, 1e-6) \
        if head_norms else None
    results = []
    for deferred in (True, False):
        if deferred:
            qkv, _, delta = gemv_lora_deferred(PLAIN, x, w, None, lora)
        else:
            qkv, delta = gemv_lora(x, w, None, lora), None
        q, k, v = qkv.split(list(slices), dim=-1)
        q, k, v = q.view(1, hq, d), k.view(1, hkv, d), v.view(1, hkv, d)
        kv_cache = torch.zeros(2, 4, block, hkv, d, device=device)
        apply_rotary(q, k, pos, cache, v=v, kv_cache=kv_cache, slot_mapping=slots, head_norms=norms, delta=delta)
        results.append((q.clone(), k.clone(), v.clone(), kv_cache))
    for got, want in zip(results[0], results[1]):
        assert _rel_err(got, want) <= 1e-5
    assert results[0][3].abs().sum() > 0


def test_one_slot_reads_slot_zero_without_the_index(device):
    """With one slot (--max-loras 1) the shrink programs read slot 0's A whatever the index says; a row
    of -1 still gets the bare product (nobody adds the delta), a row of 0 the adapter's."""
    from tokenforge.kernels.gemv_lora import gemv_lora_ref    # noqa: PLC0415

    for dtype in _dtypes():
        w, lora, x = _problem((80, 48), 320, 0, dtype, device, slots=1)
        for slot in (0, -1):
            lora.indices.fill_(slot)
            for y in (gemv_lora(x, w, None, lora), lora_delta_ref(*gemv_lora_deferred(PLAIN, x, w, None, lora)[::2])):
                assert _rel_err(y, gemv_lora_ref(x, w, None, lora)[0]) <= _tol(dtype)
        assert _rel_err(gemv_lora(x, w, None, lora), x @ w.t()) <= _tol(dtype)
