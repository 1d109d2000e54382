"""GGUF weights computed as stored on the CPU (model/quant/gguf_native.py): tiny GGUF files of each
native type, written with the gguf library (its quantizers, or the documented K-quant layout),
loaded both ways. The native model's logits (C++ kernel, and the torch fallback without a
compiler) must follow the same weights dequantized to float32 within the error of 8-bit activations."""

from __future__ import annotations

import pytest
import torch

from tests.model.gguf_builder import K_QUANTS, K_SHAPE, TinyLlama, write_tiny_gguf
from tokenforge.kernels import gguf_cpu
from tokenforge.model.loader import load_model
from tokenforge.model.quant.gguf_native import DEQUANTIZE_ROWS, GGUFNative

PROMPTS = [[1, 5, 17, 33, 2, 60, 61, 9], list(range(10, 40))]
CASES = {"Q4_0": ("Q4_0", None), "Q4_1": ("Q4_1", None), "Q8_0": ("Q8_0", None), "Q4_K": ("Q4_K", None),
         "Q5_K": ("Q5_K", None), "Q6_K": ("Q6_K", None),
         "Q4_K_M-like": ("Q4_K", {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K", "token_embd.weight": "Q8_0"})}


def _logits(model, paged_driver) -> torch.Tensor:
    driver = paged_driver(model, block_size=4)
    return torch.cat([driver.step([(str(i), p)])[0] for i, p in enumerate(PROMPTS)])


@pytest.fixture(scope="module", params=list(CASES))
def loaded(request, tmp_path_factory):
    weight_type, mixed = CASES[request.param]
    shape = K_SHAPE if weight_type in K_QUANTS else TinyLlama()
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", weight_type, shape, mixed=mixed)
    native = load_model(path, "auto", torch.float32, "cpu", gguf_native=True).model
    dequantized = load_model(path, "auto", torch.float32, "cpu").model
    return request.param, native, dequantized


def test_every_linear_runs_natively_and_frees_its_float_weight(loaded):
    _, native, dequantized = loaded
    linears = [m for m in native.modules() if hasattr(m, "packed_weight")]
    assert len(linears) == 2 * 4 + 1 and all(isinstance(m.quant_method, GGUFNative) for m in linears)
    assert all(m.weight.numel() == 0 for m in linears)
    assert not any(getattr(m, "quant_method", None) for m in dequantized.modules())


@pytest.mark.parametrize("path", ["native", "no-compiler"])
def test_logits_follow_the_dequantized_weights(loaded, paged_driver, monkeypatch, path):
    """Both the C++ kernel and the torch fallback (the same numbers, up to float summation order,
    which flips an activation's rounding now and then: so no tighter bound at the model level;
    tests/kernels/test_gguf_cpu.py holds the kernel to the reference exactly)."""
    kind, native, dequantized = loaded
    if path == "no-compiler":
        monkeypatch.setattr(gguf_cpu, "native_library", lambda: None)
    got, expected = _logits(native, paged_driver), _logits(dequantized, paged_driver)
    rel = ((got - expected).norm() / expected.norm()).item()
    print(f"\n[tokenforge] {kind} ({path}): logits vs float32 dequantized, relative error {rel:.2e}")
    assert rel < 0.03, f"{kind}: relative logit error {rel:.3f}"
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_long_prefill_chunks_run_the_dequantized_weight(loaded):
    """Above DEQUANTIZE_ROWS rows a layer multiplies its dequantized blocks in float (no 8-bit
    activations): exactly the float32 path's product."""
    _, native, dequantized = loaded
    x = torch.randn(DEQUANTIZE_ROWS + 1, native.config.hidden_size)
    layer, reference = native.model.layers[0].mlp.gate_up_proj, dequantized.model.layers[0].mlp.gate_up_proj
    torch.testing.assert_close(layer(x), reference(x), rtol=1e-5, atol=1e-5)
    short = layer(x[:DEQUANTIZE_ROWS])
    assert not torch.allclose(short, reference(x[:DEQUANTIZE_ROWS]), rtol=1e-5, atol=1e-5)   # 8-bit activations
