"""Llama 3.1 / 3.2 GGUF files carry their llama3 rotary scaling as a `rope_freqs` tensor (one
divisor per rotary frequency, as llama.cpp's converter writes it), not as metadata. The loader
reads it into the config's RopeScaling.freq_factors: a tiny GGUF with those divisors gives HF
transformers' logits for the same weights under rope_type llama3, past the original context."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.model.gguf_builder import TinyLlama, write_tiny_gguf
from tokenforge.model.loader import load_model
from tokenforge.model.loader.gguf_file import GGUFFile, GGUFFormatError
from tokenforge.model.loader.gguf_loader import arch_config_from_gguf, gguf_weights

SHAPE = TinyLlama()
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
PROMPT = [(7 * i + 3) % SHAPE.vocab for i in range(48)]        # positions 0-47: three times the original context


def _hf_config():
    from transformers import LlamaConfig

    s = SHAPE
    return LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                       num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                       max_position_embeddings=s.context, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       rope_parameters={"rope_theta": 10000.0, **LLAMA3})


def _llama3_divisors() -> np.ndarray:
    """What llama.cpp's converter writes: the default inverse frequencies over llama3's."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _hf_config()
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    head_dim = SHAPE.hidden // SHAPE.heads
    default = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return (default / scaled).numpy()


def _our_logits(path, paged_driver) -> torch.Tensor:
    model = load_model(path, "auto", torch.float32, "cpu").model
    return paged_driver(model, block_size=4).step([("a", PROMPT)])[0]


def test_rope_freqs_give_hf_llama3_logits(tmp_path, paged_driver):
    from transformers import LlamaForCausalLM

    path = write_tiny_gguf(tmp_path / "llama3.gguf", "F32", rope_freqs=_llama3_divisors())
    gguf = GGUFFile(path)
    config = arch_config_from_gguf(gguf)
    assert config.rope_scaling.freq_factors is not None and len(config.rope_scaling.freq_factors) == 8
    hf = LlamaForCausalLM(_hf_config()).eval()
    missing, unexpected = hf.load_state_dict(dict(gguf_weights(gguf, config)), strict=False)
    assert not unexpected and set(missing) <= {"model.rotary_emb.inv_freq"}
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].float()
    ours = _our_logits(path, paged_driver)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    # the same weights without the divisors: other logits (so the comparison above has a subject)
    plain = _our_logits(write_tiny_gguf(tmp_path / "plain.gguf", "F32"), paged_driver)
    assert (plain - expected).abs().max() > 1e-2


@pytest.mark.parametrize("freqs, words", [
    (np.ones(9), r"'rope_freqs.weight' shape.*\[9\] is not one factor per rotary frequency \(expected \[8\]"),
    (np.array([1.0] * 7 + [0.0]), "'rope_freqs.weight'.*not a positive finite number"),
    (np.array([1.0] * 7 + [np.nan]), "'rope_freqs.weight'.*not a positive finite number"),
])
def test_a_bad_rope_freqs_tensor_is_one_error_naming_it(tmp_path, freqs, words):
    path = write_tiny_gguf(tmp_path / "bad.gguf", "F32", rope_freqs=freqs)
    with pytest.raises(GGUFFormatError, match=words):
        load_model(path, "auto", torch.float32, "cpu")
