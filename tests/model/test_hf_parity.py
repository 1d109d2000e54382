"""Logits parity with HF transformers on tiny random Llama / Mistral / Qwen2 checkpoints, run through
our safetensors loader and the paged torch backend (chunked prefill, batched and mixed decode)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tokenforge.model.loader import load_model

ATOL = 1e-4
_COMMON = dict(hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=331, max_position_embeddings=512, rms_norm_eps=1e-5,
               initializer_range=0.1)  # larger than HF default so positions and caching visibly matter


def _llama():
    cfg = LlamaConfig(**_COMMON, tie_word_embeddings=False, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    return LlamaForCausalLM(cfg)


def _llama_tied():
    return LlamaForCausalLM(LlamaConfig(**{**_COMMON, "num_key_value_heads": 1}, tie_word_embeddings=True))


def _llama_biases():
    """Llama's attention_bias (q, k, v and o_proj) and mlp_bias (gate, up, down)."""
    return LlamaForCausalLM(LlamaConfig(**_COMMON, tie_word_embeddings=False, attention_bias=True, mlp_bias=True))


def _mistral():
    return MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=None, rope_theta=1e6))


def _qwen2():
    return Qwen2ForCausalLM(Qwen2Config(**_COMMON, tie_word_embeddings=False))


@pytest.fixture(scope="module", params=[_llama, _llama_tied, _llama_biases, _mistral, _qwen2],
                ids=["llama3", "llama-tied", "llama-biases", "mistral", "qwen2"])
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = request.param().eval()
    for name, param in hf.named_parameters():   # HF inits biases at zero: make them matter
        if name.endswith(".bias"):
            torch.nn.init.normal_(param, std=0.5)
    path = tmp_path_factory.mktemp("ckpt")
    hf.save_pretrained(path)
    return hf, path


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def test_attention_bias_follows_architecture(checkpoint):
    hf, path = checkpoint
    loaded = load_model(str(path), "auto", torch.float32, "cpu")
    cfg = hf.config
    assert loaded.arch_config.attention_bias == (isinstance(hf, Qwen2ForCausalLM) or getattr(cfg, "attention_bias", False))
    layer = loaded.model.model.layers[0]
    assert (layer.self_attn.qkv_proj.bias is not None) == loaded.arch_config.attention_bias
    # Llama's attention_bias covers o_proj, Qwen2's (implied) does not; mlp_bias the MLP's three
    assert (layer.self_attn.o_proj.bias is not None) == (not isinstance(hf, Qwen2ForCausalLM)
                                                         and getattr(cfg, "attention_bias", False))
    assert (layer.mlp.down_proj.bias is not None) == (layer.mlp.gate_up_proj.bias is not None) \
        == bool(getattr(cfg, "mlp_bias", False))


def test_paged_logits_match_hf(checkpoint, paged_driver):
    hf, path = checkpoint
    model = load_model(str(path), "auto", torch.float32, "cpu").model
    driver = paged_driver(model, block_size=4)
    gen = torch.Generator().manual_seed(1)
    seqs = {name: torch.randint(0, 331, (n,), generator=gen).tolist()
            for name, n in (("a", 15), ("b", 9), ("c", 23), ("d", 6))}
    # (seq, start, end) chunks per step: whole prompts, a prompt in two chunks (the second attends
    # to cached context), a pure batched decode, and a mixed step with the prefill before the decodes.
    steps = [
        [("a", 0, 13), ("c", 0, 9)],
        [("c", 9, 21), ("b", 0, 7)],
        [("a", 13, 14), ("b", 7, 8), ("c", 21, 22)],
        [("d", 0, 6), ("a", 14, 15), ("b", 8, 9), ("c", 22, 23)],
    ]
    reference = {name: _hf_logits(hf, toks) for name, toks in seqs.items()}
    for step in steps:
        outs = driver.step([(name, seqs[name][s:e]) for name, s, e in step])
        for (name, s, e), ours in zip(step, outs):
            err = (ours - reference[name][s:e]).abs().max().item()
            assert err < ATOL, f"{name}[{s}:{e}] max abs error {err:.2e}"
