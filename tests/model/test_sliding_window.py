"""Sliding-window attention against HF transformers on tiny random Mistral and Qwen2 checkpoints
whose window (5 tokens) is much shorter than the prompts: logits past the window within fp32
tolerance through the paged torch backend (whole prompts, chunked prefill attending to cached
context, mixed and batched decode over many blocks), and greedy tokens identical to HF's
`generate`. Qwen2 slides only from `max_window_layers` on, so its first layer stays full; Qwen3-MoE
(HF has no max_window_layers rule there) slides on every layer, and Qwen2-MoE's config without
layer_types on the even layers below max_window_layers, as HF's configs decide."""

from __future__ import annotations

import pytest
import torch
from transformers import (MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

from tokenforge.model.loader import load_model
from tokenforge.model.models.qwen2_moe import qwen2_moe_config_extras

ATOL = 1e-4
WINDOW = 5
_COMMON = dict(hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=331, max_position_embeddings=512, rms_norm_eps=1e-5,
               initializer_range=0.1, tie_word_embeddings=False)


def _mistral(window):
    return MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=window, rope_theta=1e6))


def _qwen2(window):
    return Qwen2ForCausalLM(Qwen2Config(**_COMMON, use_sliding_window=window is not None,
                                        sliding_window=window or 4096, max_window_layers=1))


def _qwen3_moe(window):
    """max_window_layers=2 would keep layers 0-1 full under Qwen2's rule; HF's Qwen3-MoE ignores it."""
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**_COMMON, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                              head_dim=16, use_sliding_window=window is not None,
                                              sliding_window=window or 4096, max_window_layers=2))


@pytest.fixture(scope="module", params=[_mistral, _qwen2, _qwen3_moe], ids=["mistral", "qwen2", "qwen3_moe"])
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = request.param(WINDOW).eval()
    path = tmp_path_factory.mktemp("swa")
    hf.save_pretrained(path)
    full = request.param(None).eval()            # the same weights with full attention
    full.load_state_dict(hf.state_dict())
    return hf, full, path


def _logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def test_config_names_the_sliding_layers(checkpoint):
    hf, _, path = checkpoint
    arch = load_model(str(path), "auto", torch.float32, "cpu").arch_config
    windows = [arch.sliding_window_of(i) for i in range(arch.num_hidden_layers)]
    assert windows == ([None, WINDOW, WINDOW] if isinstance(hf, Qwen2ForCausalLM) else [WINDOW] * 3)


def test_qwen2_moe_without_layer_types_slides_where_hf_does():
    """HF's Qwen2-MoE config: sliding on even layers below max_window_layers (a config.json that
    lists no layer_types, as older ones do); one listing them is taken as it stands."""
    cfg = dict(num_hidden_layers=6, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
               use_sliding_window=True, sliding_window=7, max_window_layers=4)
    assert qwen2_moe_config_extras(cfg)["layer_types"] == ("sliding_attention", "full_attention") * 2 + ("full_attention",) * 2
    listed = ["full_attention"] * 5 + ["sliding_attention"]
    assert qwen2_moe_config_extras({**cfg, "layer_types": listed})["layer_types"] == tuple(listed)
    assert qwen2_moe_config_extras({**cfg, "use_sliding_window": False})["sliding_window"] is None


def test_window_changes_hf_logits(checkpoint):
    """The check below can fail: past the window, windowed and full attention differ visibly."""
    hf, full, _ = checkpoint
    tokens = list(range(3, 40))
    gap = (_logits(hf, tokens)[WINDOW + 2:] - _logits(full, tokens)[WINDOW + 2:]).abs().max().item()
    assert gap > 100 * ATOL


def test_paged_logits_match_hf_past_the_window(checkpoint, paged_driver):
    hf, _, path = checkpoint
    model = load_model(str(path), "auto", torch.float32, "cpu").model
    driver = paged_driver(model, block_size=4)
    gen = torch.Generator().manual_seed(1)
    seqs = {name: torch.randint(0, 331, (n,), generator=gen).tolist()
            for name, n in (("a", 19), ("b", 11), ("c", 31), ("d", 8))}
    steps = [
        [("a", 0, 13), ("c", 0, 3)],                          # c's first chunk is shorter than the window
        [("c", 3, 17), ("b", 0, 9)],                          # a chunk over cached context, crossing the window
        [("a", 13, 14), ("b", 9, 10), ("c", 17, 18)],         # batched decode of unequal lengths
        [("d", 0, 8), ("a", 14, 15), ("c", 18, 26)],          # mixed: prefill, decode, chunk
        *[[("a", 15 + i, 16 + i), ("c", 26 + i, 27 + i)] + ([("b", 10, 11)] if i == 0 else [])
          for i in range(4)],                                 # decodes across many blocks
    ]
    reference = {name: _logits(hf, toks) for name, toks in seqs.items()}
    for step in steps:
        outs = driver.step([(name, seqs[name][s:e]) for name, s, e in step])
        for (name, s, e), ours in zip(step, outs):
            err = (ours - reference[name][s:e]).abs().max().item()
            assert err < ATOL, f"{name}[{s}:{e}] max abs error {err:.2e}"


def test_greedy_tokens_match_hf_generate(checkpoint, paged_driver):
    hf, _, path = checkpoint
    prompt = list(range(7, 7 + 3 * WINDOW))
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    driver = paged_driver(load_model(str(path), "auto", torch.float32, "cpu").model, block_size=4)
    logits = driver.step([("s", prompt[:9])])[0]
    logits = driver.step([("s", prompt[9:])])[0]          # the rest of the prompt over cached context
    got = []
    for _ in range(24):
        got.append(int(logits[-1].argmax()))
        logits = driver.step([("s", got[-1:])])[0]
    assert got == want


def test_training_forward_slides_too(checkpoint):
    """The training forward ([B, S] ids, positions None) is the same forward: HF's logits per row."""
    hf, _, path = checkpoint
    model = load_model(str(path), "auto", torch.float32, "cpu").model
    ids = torch.randint(0, 331, (2, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model.compute_logits(model(ids, None))                    # [2, 17, V]
        theirs = hf(ids).logits
    assert (ours - theirs).abs().max().item() < ATOL
