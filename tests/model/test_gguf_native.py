"""GGUF weights computed as stored on the CPU (model/quant/gguf_native.py).

Tiny GGUF files of each native type, written with the gguf library (its quantizers, or the
documented K-quant layout), are loaded both ways: the native model's logits (C++ kernel, and the
torch fallback without a compiler) must follow the same weights dequantized to float32 within the
error of 8-bit activations. On the bundled model, greedy decoding natively is held to the float32
path token by token, except where float32 itself has a near tie."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.model.gguf_builder import K_QUANTS, K_SHAPE, TinyLlama, write_tiny_gguf
from tokenforge.kernels import gguf_cpu
from tokenforge.model.loader import load_model
from tokenforge.model.quant.dense import DenseMethod
from tokenforge.model.quant.gguf_native import DEQUANTIZE_ROWS, GgufNativeMethod

PROMPTS = [[1, 5, 17, 33, 2, 60, 61, 9], list(range(10, 40))]
CASES = {"Q4_0": ("Q4_0", None), "Q4_1": ("Q4_1", None), "Q5_0": ("Q5_0", None), "Q5_1": ("Q5_1", None),
         "Q8_0": ("Q8_0", None), "Q4_K": ("Q4_K", None),
         "Q5_K": ("Q5_K", None), "Q6_K": ("Q6_K", None),
         "Q4_K_M-like": ("Q4_K", {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K", "token_embd.weight": "Q8_0"})}


def _logits(model, paged_driver) -> torch.Tensor:
    driver = paged_driver(model, block_size=4)
    return torch.cat([driver.step([(str(i), p)])[0] for i, p in enumerate(PROMPTS)])


def _linears(model) -> list:
    return [m for m in model.modules() if hasattr(m, "quant_method")]


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
    linears = _linears(native)
    assert len(linears) == 2 * 4 + 1 and all(isinstance(m.quant_method, GgufNativeMethod) for m in linears)
    assert all(m.weight is None and m.gguf_weight for m in linears)
    assert all(isinstance(m.quant_method, DenseMethod) for m in _linears(dequantized))


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


def test_long_prefill_chunks_run_the_dequantized_weight(loaded, monkeypatch):
    """Above DEQUANTIZE_ROWS rows a layer multiplies its dequantized blocks in float (no 8-bit
    activations). In float32 (the fallback without native bf16, forced here) that is exactly the
    float32 path's product."""
    _, native, dequantized = loaded
    x = torch.randn(DEQUANTIZE_ROWS + 1, native.config.hidden_size)
    layer, reference = native.model.layers[0].mlp.gate_up_proj, dequantized.model.layers[0].mlp.gate_up_proj
    monkeypatch.setattr(layer, "quant_method", GgufNativeMethod(torch.float32))
    torch.testing.assert_close(layer(x), reference(x), rtol=1e-5, atol=1e-5)
    short = layer(x[:DEQUANTIZE_ROWS])
    assert not torch.allclose(short, reference(x[:DEQUANTIZE_ROWS]), rtol=1e-5, atol=1e-5)   # 8-bit activations


def test_long_prefill_chunks_in_bf16_are_the_bf16_product(loaded, monkeypatch):
    """With native bf16 (AVX512-BF16) a long chunk multiplies bf16 activations by the blocks
    dequantized to bf16: torch's bf16 product of the float32 path's weight and input, within bf16
    rounding of the float32 product."""
    _, native, dequantized = loaded
    x = torch.randn(DEQUANTIZE_ROWS + 3, native.config.hidden_size)
    layer, reference = native.model.layers[0].self_attn.qkv_proj, dequantized.model.layers[0].self_attn.qkv_proj
    monkeypatch.setattr(layer, "quant_method", GgufNativeMethod(torch.bfloat16))
    got = layer(x)
    bias = None if reference.bias is None else reference.bias.float()
    expected = torch.nn.functional.linear(x.bfloat16(), reference.weight.bfloat16()).float()
    torch.testing.assert_close(got, expected if bias is None else expected + bias, rtol=0, atol=0)
    exact = reference(x).detach()
    assert float((got - exact).norm() / exact.norm()) < 1e-2      # bf16 inputs and output: ~0.3% each


def test_the_long_chunk_dtype_follows_the_cpu(monkeypatch):
    """Chosen once from the CPU's features (the engine's method, made at the first GGUF load): the
    integer kernels where the library has AVX-512 VNNI, else bf16 only where the CPU has native
    bf16 dot products, else float32; never int8 without a compiler (the reference is float64)."""
    from tokenforge.model.quant import gguf_native  # noqa: PLC0415

    assert gguf_native.gguf_native_method().long_chunk_dtype == gguf_native.long_chunk_dtype_for_cpu()
    vnni = bool(gguf_cpu.native_library().tf_has_avx512_vnni())
    assert (gguf_native.long_chunk_dtype_for_cpu() == torch.int8) == vnni
    monkeypatch.setattr(gguf_native, "native_library", lambda: None)
    for native_bf16, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=native_bf16: v)
        assert gguf_native.long_chunk_dtype_for_cpu() == dtype
        assert GgufNativeMethod().long_chunk_dtype == dtype


def test_long_prefill_chunks_in_int8_take_the_integer_kernels_and_fused_prologues(loaded, monkeypatch):
    """With the int8 choice a long chunk is the short chunks' computation: row by row the same
    8-bit products, and the fused add + RMSNorm / SwiGLU prologues run at that size too."""
    _, native, _ = loaded
    x = torch.randn(DEQUANTIZE_ROWS + 9, native.config.hidden_size)
    layer = native.model.layers[0].mlp.gate_up_proj
    method = GgufNativeMethod(torch.int8)
    monkeypatch.setattr(layer, "quant_method", method)
    long = layer(x)
    torch.testing.assert_close(long[:5], layer(x[:5]), rtol=1e-6, atol=1e-6)
    expected = [gguf_cpu.gguf_matmul_ref(x, w) for w in layer.gguf_weight]
    torch.testing.assert_close(long, torch.cat(expected, dim=-1), rtol=1e-4, atol=1e-4 * long.abs().max().item())
    gate_up = torch.randn(DEQUANTIZE_ROWS + 9, 2 * native.config.intermediate_size)
    assert method.apply_silu_mul(native.model.layers[0].mlp.down_proj, gate_up, None) is not None
    assert GgufNativeMethod(torch.bfloat16).apply_silu_mul(native.model.layers[0].mlp.down_proj, gate_up, None) is None


LOGIT_STD = 2.0   # the random tiny models' logits are nearly flat: scaled to this spread, scores depend on the weights


def _sampled_text(model, paged_driver, length: int = 32, seed: int = 0) -> tuple[list[int], float]:
    """A text the model itself finds likely (tokens sampled one by one from its sharpened
    distribution, seeded) and the sharpening: LOGIT_STD over its first logits' spread."""
    driver, gen = paged_driver(model, block_size=4), torch.Generator().manual_seed(seed)
    ids, sharpen = [1], None
    while len(ids) < length:
        logits = driver.step([("text", ids[-1:])])[0][-1]
        sharpen = sharpen or LOGIT_STD / float(logits.std())
        ids.append(int(torch.multinomial((sharpen * logits).softmax(-1), 1, generator=gen)))
    return ids, sharpen


def _perplexity(model, paged_driver, ids: list[int], sharpen: float) -> float:
    """exp(mean NLL of ids[1:]): the text as one prefill chunk (at most DEQUANTIZE_ROWS rows: the
    native model computes it with 8-bit activations and the integer kernels)."""
    assert len(ids) <= DEQUANTIZE_ROWS
    logits = paged_driver(model, block_size=4).step([("ppl", ids)])[0]
    nll = -(sharpen * logits[:-1]).log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).mean()
    return float(nll.exp())


def test_perplexity_within_one_percent_of_the_dequantized_weights(loaded, paged_driver):
    """The quality target per GGUF type: native perplexity within +1% of the same weights
    dequantized to float32, on a text sampled from the float model. The logits are sharpened by
    the same factor on both sides (which scales their differences too), so the perplexity sits well below
    the vocabulary's uniform one and depends on the weights."""
    kind, native, dequantized = loaded
    ids, sharpen = _sampled_text(dequantized, paged_driver)
    ppl_native = _perplexity(native, paged_driver, ids, sharpen)
    ppl_float = _perplexity(dequantized, paged_driver, ids, sharpen)
    print(f"\n[tokenforge] {kind}: perplexity native {ppl_native:.4f}, float32 {ppl_float:.4f} "
          f"({(ppl_native / ppl_float - 1) * 100:+.3f}%)")
    assert ppl_float < 0.75 * native.config.vocab_size, f"{kind}: the sampled text is not informative"
    assert abs(ppl_native / ppl_float - 1) < 0.01, f"{kind}: {ppl_native:.4f} vs {ppl_float:.4f}"


def test_an_unsupported_type_says_so_in_one_line_and_runs_dequantized(tmp_path, paged_driver, caplog):
    """TQ2_0 (ternary) has no native kernel: its layers keep the float path (one warning line names
    the type, the native ones and the fallback); the others still run natively."""
    path = write_tiny_gguf(tmp_path / "mixed.gguf", "Q8_0", K_SHAPE, mixed={"ffn_down.weight": "TQ2_0"})
    with caplog.at_level(logging.WARNING, logger="tokenforge.model.quant.gguf_native"):
        native = load_model(path, "auto", torch.float32, "cpu", gguf_native=True).model
    lines = [r.getMessage() for r in caplog.records if r.name == "tokenforge.model.quant.gguf_native"]
    assert lines == ["GGUF type TQ2_0 (2 tensors, e.g. blk.0.ffn_down.weight) has no native CPU kernel (native: "
                     "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): those linears run dequantized to float32"]
    methods = {n: type(m.quant_method) for n, m in native.named_modules() if hasattr(m, "quant_method")}
    assert {methods[f"model.layers.{i}.mlp.down_proj"] for i in range(2)} == {DenseMethod}
    assert methods["model.layers.0.mlp.gate_up_proj"] is GgufNativeMethod
    dequantized = load_model(path, "auto", torch.float32, "cpu").model
    got, expected = _logits(native, paged_driver), _logits(dequantized, paged_driver)
    assert ((got - expected).norm() / expected.norm()).item() < 0.03


BUNDLED_PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5,", "Once upon a time, in a small village by the sea,",
                   "Q: Why is the sky blue?\nA:"]
GREEDY_TOKENS = 16


@pytest.mark.slow
def test_bundled_greedy_follows_the_float32_path(paged_driver):
    """The bundled Q4_1 model decoded greedily, natively (one row per step: the integer kernels),
    then the float32 path teacher-forced on the same tokens. Measured on 10 prompts x 24 tokens:
    236 of 240 greedy tokens equal float32's argmax; each of the other four is a near tie in
    float32 (its logit within 0.23 of the maximum); the native logits are within 2-5% (mean per
    prompt) and 12% (worst row) relative L2 of float32's, the error of 8-bit activations over 30
    layers. A divergence at a clear float32 choice would fail."""
    from tokenforge.engine.tokenization import load_engine_tokenizer
    from tokenforge.model.loader import find_bundled_gguf

    native = load_model(None, "auto", torch.float32, "cpu", gguf_native=True).model
    reference = load_model(None, "auto", torch.float32, "cpu").model
    tokenizer = load_engine_tokenizer(str(find_bundled_gguf()))
    agree = total = 0
    for prompt in BUNDLED_PROMPTS:
        ids = tokenizer.encode(prompt)
        driver = paged_driver(native)
        rows, seq = [driver.step([("s", ids)])[0][-1]], list(ids)
        for _ in range(GREEDY_TOKENS - 1):
            seq.append(int(rows[-1].argmax()))
            rows.append(driver.step([("s", [seq[-1]])])[0][-1])
        chosen = torch.stack(rows).argmax(-1)                                      # [N]
        got = torch.stack(rows)
        expected = paged_driver(reference).step([("s", seq)])[0][len(ids) - 1:]   # [N, V], float32 teacher-forced
        rel = (got - expected).norm(dim=-1) / expected.norm(dim=-1)
        margin = expected.max(-1).values - expected.gather(1, chosen[:, None])[:, 0]
        print(f"\n[tokenforge] {prompt!r}: {(margin == 0).sum().item()}/{GREEDY_TOKENS} greedy tokens equal float32's; "
              f"worst margin {margin.max():.3f}; relative logit error mean {rel.mean():.3f} max {rel.max():.3f}")
        assert rel.mean() < 0.08 and rel.max() < 0.2, rel
        assert margin.max() < 0.5, f"{prompt!r}: native greedy left a clear float32 choice (margin {margin.max():.3f})"
        agree, total = agree + int((margin == 0).sum()), total + GREEDY_TOKENS
    assert agree >= 0.9 * total
