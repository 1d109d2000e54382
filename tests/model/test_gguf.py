"""The bundled SmolLM2 GGUF: our reader/dequantizer against the gguf library, and our model's
logits against HF transformers' GGUF-loaded model."""

from __future__ import annotations

import time

import gguf
import numpy as np
import pytest
import torch

from tokenforge.model.loader import load_model
from tokenforge.model.loader.gguf_file import GGUFFile, dequantize

pytestmark = pytest.mark.slow

PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11, 2574, 417, 2],
    list(range(100, 160)),
    [28, 2137, 1345, 30, 253, 9101, 29, 198, 1500, 38, 2],
]


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "F16", "BF16"])
def test_fast_dequantize_matches_gguf_library(kind):
    qtype = gguf.GGMLQuantizationType[kind]
    values = np.random.default_rng(0).standard_normal((8, 96)).astype(np.float32)
    packed = gguf.quants.quantize(values, qtype)
    expected = gguf.quants.dequantize(packed, qtype)
    ours = dequantize(torch.from_numpy(packed.view(np.uint8).reshape(-1).copy()), int(qtype))
    np.testing.assert_array_equal(ours.numpy().reshape(expected.shape), expected)


def test_reader_matches_gguf_library_on_bundled_file(bundled_gguf):
    f = GGUFFile(bundled_gguf)
    assert f.metadata["general.architecture"] == "llama" and len(f.tensors) == 272
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight", "output_norm.weight"):
        info = f.tensors[name]
        raw = f.raw(name).numpy().reshape(info.shape[0], -1)
        expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(info.ggml_type))
        np.testing.assert_array_equal(f.load(name).numpy(), expected.reshape(info.shape))


@pytest.fixture(scope="module")
def ours():
    start = time.perf_counter()
    loaded = load_model(None, "auto", torch.float32, "cpu")
    print(f"\n[tokenforge] bundled GGUF load: {time.perf_counter() - start:.2f} s")
    return loaded


def test_arch_config_from_gguf(ours):
    cfg = ours.arch_config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (576, 30, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)
    assert cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192


def test_logits_match_hf_gguf_model(ours, hf_gguf_model, paged_driver):
    driver = paged_driver(ours.model, block_size=16)
    worst = 0.0
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            expected = hf_gguf_model(torch.tensor([prompt])).logits[0].float()
        split = len(prompt) // 2        # the second half attends to the first half through the cache
        got = torch.cat([driver.step([(str(i), prompt[:split])])[0], driver.step([(str(i), prompt[split:])])[0]])
        err = (got - expected).abs().max().item()
        worst = max(worst, err)
        assert err < 5e-4, f"prompt {i}: max abs logit error {err:.2e}"
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
    print(f"\n[tokenforge] GGUF logits max abs error vs HF: {worst:.2e}")
