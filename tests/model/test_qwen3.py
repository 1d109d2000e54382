"""Qwen3 (q/k RMSNorm per head, head_dim apart from hidden/heads) against HF transformers on a
tiny random checkpoint: paged logits through chunked prefill and batched decode, greedy tokens
identical to HF's `generate`, and the parameter count from the meta-device build."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from tokenforge.model.loader import load_model

ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(
        hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, vocab_size=331, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1,
        tie_word_embeddings=False, rope_theta=1e6)).eval()
    for layer in hf.model.layers:           # HF inits the q/k norms at one: make them matter
        torch.nn.init.normal_(layer.self_attn.q_norm.weight, 1.0, 0.3)
        torch.nn.init.normal_(layer.self_attn.k_norm.weight, 1.0, 0.3)
    path = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(path)
    return hf, path


def _logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def test_paged_logits_match_hf(checkpoint, paged_driver):
    hf, path = checkpoint
    loaded = load_model(str(path), "auto", torch.float32, "cpu")
    assert loaded.arch_config.architecture == "Qwen3ForCausalLM" and not loaded.arch_config.attention_bias
    driver = paged_driver(loaded.model, block_size=4)
    gen = torch.Generator().manual_seed(1)
    seqs = {name: torch.randint(0, 331, (n,), generator=gen).tolist() for name, n in (("a", 15), ("b", 9), ("c", 23))}
    steps = [
        [("a", 0, 13), ("c", 0, 9)],
        [("c", 9, 21), ("b", 0, 7)],
        [("a", 13, 14), ("b", 7, 8), ("c", 21, 22)],
        [("a", 14, 15), ("b", 8, 9), ("c", 22, 23)],
    ]
    reference = {name: _logits(hf, toks) for name, toks in seqs.items()}
    for step in steps:
        outs = driver.step([(name, seqs[name][s:e]) for name, s, e in step])
        for (name, s, e), ours in zip(step, outs):
            err = (ours - reference[name][s:e]).abs().max().item()
            assert err < ATOL, f"{name}[{s}:{e}] max abs error {err:.2e}"


def test_greedy_tokens_match_hf_generate(checkpoint, paged_driver):
    hf, path = checkpoint
    prompt = list(range(11, 30))
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    driver = paged_driver(load_model(str(path), "auto", torch.float32, "cpu").model, block_size=4)
    logits = driver.step([("s", prompt)])[0]
    got = []
    for _ in range(20):
        got.append(int(logits[-1].argmax()))
        logits = driver.step([("s", got[-1:])])[0]
    assert got == want


def test_parameter_count_matches_hf(checkpoint):
    hf, path = checkpoint
    arch = load_model(str(path), "auto", torch.float32, "cpu").arch_config
    assert arch.num_parameters() == sum(p.numel() for p in hf.parameters())
