"""The native decode step (model/native_decode.py, kernels/gguf_decode.cpp) against the model's
per-op forward on the gguf-native method, its reference: tiny GGUF files of several types (and a
Q4_K_M-like mix), two sequences in shuffled 4-token blocks, decode steps compared one by one (both
paths start from the same cache). The two differ only where attention is computed (SDPA there, a
float32 loop here: ~1e-7 relative), which can flip the 8-bit rounding of a rare activation, so
the bounds are relative norms well below what a wrong head, position, block or bias gives (O(1)).
"""

from __future__ import annotations

import pytest
import torch

from tests.model.gguf_builder import K_QUANTS, K_SHAPE, TinyLlama, write_tiny_gguf
from tokenforge.model.attention.spec import AttentionSpec
from tokenforge.model.forward_context import set_forward_context
from tokenforge.model.loader import load_model
from tokenforge.kernels import gguf_decode
from tokenforge.kernels.gguf_decode import ThreadChoice
from tokenforge.model.native_decode import NativeDecoder

CASES = {"Q4_0": ("Q4_0", None), "Q4_1": ("Q4_1", None), "Q5_1": ("Q5_1", None), "Q8_0": ("Q8_0", None),
         "Q4_K": ("Q4_K", None), "Q6_K": ("Q6_K", None),
         "Q4_K_M-like": ("Q4_K", {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K", "token_embd.weight": "Q8_0"})}
PROMPTS = {"a": [1, 5, 17, 33, 2, 60, 61, 9], "b": list(range(10, 40))}
STEPS = 6


def _native_model(tmp_path, case: str):
    weight_type, mixed = CASES[case]
    shape = K_SHAPE if weight_type in K_QUANTS else TinyLlama()
    path = write_tiny_gguf(tmp_path / f"{case}.gguf", weight_type, shape, mixed=mixed)
    return load_model(path, "auto", torch.float32, "cpu", gguf_native=True).model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@torch.inference_mode()
def _compare(model, paged_driver, steps: int = STEPS) -> None:
    """Prefill both prompts per op, then each decode step both ways from the same cache."""
    driver = paged_driver(model, block_size=4)
    decoder, why = NativeDecoder.of(model)
    assert decoder is not None, why
    first = driver.step(list(PROMPTS.items()))
    tokens = {s: int(logits[-1].argmax()) for s, logits in zip(PROMPTS, first)}
    caches = [layer.kv_cache for layer in model.attention_layers()]
    for _ in range(steps):
        ids, positions, batch = driver.prepare([(s, [t]) for s, t in tokens.items()])
        before = [c.clone() for c in caches]
        with set_forward_context(driver.backend.build_metadata(batch)):
            expected = model(ids, positions)                                     # [2, H]
        expected_kv = [c.clone() for c in caches]
        for c, saved in zip(caches, before):
            c.copy_(saved)
        got = decoder.forward(ids, batch)
        assert got.shape == expected.shape
        assert _rel(got, expected) < 1e-4
        assert max(_rel(c, e) for c, e in zip(caches, expected_kv)) < 1e-4      # the new k/v stored in place
        logits, expected_logits = model.compute_logits(got), model.compute_logits(expected)
        # The head quantizes its input to 8 bits too: hidden states 1e-5 apart can round one element
        # differently there (seen: 1.4e-3 with one torch thread), still far below a wrong head's O(1).
        assert _rel(logits, expected_logits) < 1e-2
        assert torch.equal(logits.argmax(-1), expected_logits.argmax(-1))
        tokens = dict(zip(tokens, logits.argmax(-1).tolist()))


@pytest.mark.parametrize("case", list(CASES))
def test_native_step_follows_the_per_op_forward(tmp_path, paged_driver, case):
    _compare(_native_model(tmp_path, case), paged_driver)


def test_sliding_window_and_qkv_bias(tmp_path, paged_driver):
    """A window shorter than the prompts (layer 0 only: layers may differ, as Qwen2's do) and a
    q|k|v bias (Qwen2), both read from the layers themselves by both paths."""
    model = _native_model(tmp_path, "Q8_0")
    model.model.layers[0].self_attn.attn.spec = AttentionSpec(sliding_window=5)
    gen = torch.Generator().manual_seed(0)
    for layer in model.model.layers:
        qkv = layer.self_attn.qkv_proj
        qkv.bias = torch.nn.Parameter(torch.randn(qkv.output_size_per_rank, generator=gen) * 0.5, requires_grad=False)
    _compare(model, paged_driver)


@pytest.mark.parametrize("heads", [4, 2])
def test_vector_attention_head_sizes_and_window(tmp_path, paged_driver, heads):
    """Head sizes 64 and 128 (the AVX-512 attention's register-resident sizes; 16 above takes the
    plain loops), groups of 2 query heads, and a 21-position window: one whole 16-score vector of
    the softmax and a masked tail."""
    shape = TinyLlama(hidden=256, intermediate=512, heads=heads, kv_heads=heads // 2)
    model = load_model(write_tiny_gguf(tmp_path / f"h{heads}.gguf", "Q4_K", shape), "auto", torch.float32, "cpu",
                       gguf_native=True).model
    model.model.layers[0].self_attn.attn.spec = AttentionSpec(sliding_window=21)
    _compare(model, paged_driver)


@pytest.mark.parametrize("window", [None, 7])
def test_attention_in_chunks_follows_the_per_op_forward(tmp_path, paged_driver, monkeypatch, window):
    """A row's keys cut into chunks of 5 positions (the threads' work items; 256 in use) and merged:
    the 8- and 30-token prompts take 2-8 chunks a row, ragged last ones, and with a window a first
    chunk that starts inside the sequence."""
    monkeypatch.setattr(gguf_decode, "ATTENTION_CHUNK", 5)
    model = _native_model(tmp_path, "Q4_K_M-like")
    if window is not None:
        model.model.layers[1].self_attn.attn.spec = AttentionSpec(sliding_window=window)
    _compare(model, paged_driver)


def test_models_the_step_does_not_take_say_why(tmp_path, paged_driver):
    path = write_tiny_gguf(tmp_path / "q8.gguf", "Q8_0", TinyLlama())
    dequantized = load_model(path, "auto", torch.float32, "cpu").model
    paged_driver(dequantized)
    assert NativeDecoder.of(dequantized) == (None, "layer 0: a projection not on the gguf-native method "
                                                   "(or with LoRA, or sharded)")
    native = load_model(path, "auto", torch.float32, "cpu", gguf_native=True).model
    assert NativeDecoder.of(native) == (None, "layer 0: no float32 paged KV cache")       # before the cache exists
    paged_driver(native)
    native.model.layers[1].self_attn.attn.kv_scales = torch.ones(4)
    assert NativeDecoder.of(native) == (None, "layer 1: attention sinks, fp8 rotation, calibration or an fp8 cache")


def test_bad_block_tables_and_positions_are_refused(tmp_path, paged_driver):
    """The step reads the cache through raw pointers: what the scheduler hands it is checked first."""
    model = _native_model(tmp_path, "Q8_0")
    driver = paged_driver(model, block_size=4, num_blocks=32)
    decoder, _ = NativeDecoder.of(model)
    driver.step([("a", PROMPTS["a"])])
    ids, _, batch = driver.prepare([("a", [3])])
    batch.block_tables[0][-1] = 32
    with pytest.raises(ValueError, match=r"a block table names a block outside the cache \(0..31\)"):
        decoder.forward(ids, batch)
    batch.block_tables[0][-1] = 0
    batch.context_lens[0] = model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.shape[0]
    with pytest.raises(ValueError, match="past the model's rotary table"):
        decoder.forward(ids, batch)


@pytest.mark.parametrize("chunk", [256, 5])
def test_the_team_size_changes_no_number(tmp_path, paged_driver, monkeypatch, chunk):
    """Each output of the step has one owner whatever the thread count, and attention's chunks are
    cut by position, not by thread, so 1 and 2 threads (the counts ThreadChoice picks between) give
    bit-identical hidden states and caches, also when a row's attention spans several chunks."""
    monkeypatch.setattr(gguf_decode, "ATTENTION_CHUNK", chunk)
    model = _native_model(tmp_path, "Q4_K_M-like")
    driver = paged_driver(model, block_size=4)
    decoder, _ = NativeDecoder.of(model)
    with torch.inference_mode():
        driver.step(list(PROMPTS.items()))
        ids, _, batch = driver.prepare([(s, [7]) for s in PROMPTS])
        caches = [layer.kv_cache for layer in model.attention_layers()]
        before = [c.clone() for c in caches]
        results = []
        for threads in (1, 2):
            for c, saved in zip(caches, before):
                c.copy_(saved)
            decoder.step.choice.threads = lambda available, n=threads: n
            results.append((decoder.forward(ids, batch).clone(), [c.clone() for c in caches]))
    (h1, kv1), (h2, kv2) = results
    assert torch.equal(h1, h2) and all(torch.equal(a, b) for a, b in zip(kv1, kv2))


def test_thread_choice_keeps_the_faster_count():
    choice = ThreadChoice()
    picked = []
    for _ in range(2 * ThreadChoice.PROBE_EVERY):          # one thread twice as fast: it takes over
        n = choice.threads(2)
        picked.append(n)
        choice.record(n, 0.01 if n == 1 else 0.02)
    assert picked[:ThreadChoice.PROBE_STEPS] == [2] * ThreadChoice.PROBE_STEPS and choice.current == 1
    assert picked[-10:] == [1] * 10
    steady = ThreadChoice()
    for _ in range(2 * ThreadChoice.PROBE_EVERY):          # both alike: the full team stays
        n = steady.threads(2)
        steady.record(n, 0.01)
    assert steady.current == 2 and ThreadChoice().threads(1) == 1
