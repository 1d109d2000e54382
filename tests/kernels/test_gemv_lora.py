"""The batch-1 GEMV with the LoRA delta (kernels/gemv_lora.py: the shrink in the GEMV's grid, then
the one-row expand) against the torch reference on fresh random inputs: the three prologues,
one to three packed slices, a row without an adapter, N and K off the block multiples, and a new
slot in the same index tensor followed (what a CUDA graph replays). GPU, or Triton's interpreter
on the CPU (float32 only); Llama-3.1-8B's linear shapes on the GPU only. The linears that call
it: tests/model/test_lora.py; in the engine's CUDA graphs: tests/executor/test_gpu_lora.py."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import INTERPRET, _rel_err, _tol
from tokenforge.kernels.gemv import NORM, PLAIN, SILU_MUL, gemv_config
from tokenforge.kernels.gemv_lora import (
    GemvLoRA,
    add_rms_norm_gemv_lora,
    gemv_lora,
    gemv_lora_ref,
    silu_mul_gemv_lora,
)

SMALL = [  # (slices, K, slots, rank)
    ((98,), 600, 2, 16),                   # o / down-like: N, K off the block multiples
    ((80, 40), 512, 3, 32),                # gate_up-like
    ((64, 16, 16), 1000, 4, 16),           # qkv-like
]
LLAMA = [((4096, 1024, 1024), 4096, 4, 16), ((4096,), 4096, 4, 16), ((14336, 14336), 4096, 4, 16),
         ((4096,), 14336, 4, 16)]
PROLOGUES = {"plain": PLAIN, "norm": NORM, "norm-residual": NORM, "silu": SILU_MUL}


def _problem(slices, k, slots, rank, slot, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(slices)
    w = torch.randn(n, k, generator=g) * k ** -0.5
    lora = GemvLoRA((torch.randn(slots, len(slices) * rank, k, generator=g) * k ** -0.5).to(dtype).to(device),
                    (torch.randn(slots, n, rank, generator=g) * 0.3).to(dtype).to(device),
                    (torch.rand(slots, generator=g) + 0.5).to(device), torch.tensor([slot], device=device),
                    tuple(slices))
    return w.to(dtype).to(device), torch.randn(n, generator=g).to(dtype).to(device), lora


def _run(name, w, bias, lora, dtype, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    k = w.shape[1]
    x = torch.randn(1, 2 * k if name == "silu" else k, generator=g).to(dtype).to(device)
    residual = torch.randn(1, k, generator=g).to(dtype).to(device) if name == "norm-residual" else None
    nw = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype).to(device)
    ref, ref_res = gemv_lora_ref(x, w, bias, lora, residual, nw, 1e-5, PROLOGUES[name])
    if name == "plain":
        out, res = gemv_lora(x, w, bias, lora), None
    elif name == "silu":
        out, res = silu_mul_gemv_lora(x, w, bias, lora), None
    else:
        out, res = add_rms_norm_gemv_lora(x, residual, nw, 1e-5, w, bias, lora)
        assert res is x if residual is None else _rel_err(res, ref_res) <= _tol(dtype)
    return out, ref


def _dtypes():
    return [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("prologue", list(PROLOGUES))
@pytest.mark.parametrize("case", SMALL, ids=lambda c: f"slices{len(c[0])}-K{c[1]}")
@pytest.mark.parametrize("slot", [1, -1])
def test_matches_reference(device, case, prologue, slot):
    for dtype in _dtypes():
        w, bias, lora = _problem(*case, slot, dtype, device)
        out, ref = _run(prologue, w, bias if prologue != "silu" else None, lora, dtype, device)
        tol = _tol(dtype) * (2 if INTERPRET and prologue.startswith("norm") else 1)    # test_gemv.py's note
        assert _rel_err(out, ref) <= max(tol, 1e-3 if dtype == torch.float32 and not INTERPRET else 0)


def test_the_delta_is_there_and_follows_the_index(device):
    """A slot's delta changes the output; the same tensors with a new slot written into the index
    give that slot's result (a replayed graph), and -1 gives the bare GEMV."""
    w, _, lora = _problem((64, 16, 16), 512, 3, 16, 0, torch.float32, device)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(3)).to(device)
    outs = []
    for slot in (0, 2, -1):
        lora.indices.fill_(slot)
        outs.append(gemv_lora(x, w, None, lora))
        assert _rel_err(outs[-1], gemv_lora_ref(x, w, None, lora)[0]) <= 1e-3
    assert _rel_err(outs[2], x @ w.t()) <= 1e-3
    assert (outs[0] - outs[1]).abs().max() > 1e-2 and (outs[0] - outs[2]).abs().max() > 1e-2


@pytest.mark.skipif(INTERPRET, reason="full-size shapes are too slow for the interpreter")
@pytest.mark.parametrize("case", LLAMA, ids=lambda c: f"N{sum(c[0])}-K{c[1]}")
@pytest.mark.parametrize("prologue", ["plain", "norm-residual", "silu"])
def test_llama_shapes(device, case, prologue):
    """Llama-3.1-8B's qkv, o, gate_up and down, whose configs use 8, 4 and 2 rows per program."""
    if prologue == "silu" and case[1] != 14336 or prologue != "silu" and case[1] == 14336:
        pytest.skip("the prologue of another linear")
    assert gemv_config(1, sum(case[0]), case[1]).block_n in (2, 4, 8)
    w, bias, lora = _problem(*case, 3, torch.bfloat16, device)
    out, ref = _run(prologue, w, None, lora, torch.bfloat16, device)
    assert _rel_err(out, ref) <= _tol(torch.bfloat16)
