"""Mixture-of-experts families against HF transformers on tiny random checkpoints (fp32): Mixtral,
Qwen2-MoE (shared experts), Qwen3-MoE (a dense layer among sparse ones; renormalised and plain top-k weights), gpt-oss (sinks,
a 6-token window on alternating layers, YaRN, biases, the clamped SwiGLU, interleaved gate/up) and
gpt-oss with MXFP4 experts against transformers' own dequantization of them. Paged logits through
chunked prefill (prompts longer than the window) and batched decode within 1e-4, greedy tokens
through the public `LLM` API identical to HF's `generate`, and parameter counts."""

from __future__ import annotations

import pytest
import torch

from tests.model import moe_checkpoints
from tokenforge.model.loader import load_model

ATOL = 1e-4
CASES = {
    "mixtral": moe_checkpoints.mixtral,
    "qwen2_moe": moe_checkpoints.qwen2_moe,
    "qwen3_moe": moe_checkpoints.qwen3_moe,
    "qwen3_moe_plain_topk": lambda p: moe_checkpoints.qwen3_moe(p, norm_topk_prob=False, decoder_sparse_step=2),
    "gpt_oss": moe_checkpoints.gpt_oss,
    "gpt_oss_mxfp4": moe_checkpoints.gpt_oss_mxfp4,
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    return CASES[request.param](tmp_path_factory.mktemp(request.param))


def _logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def test_paged_logits_match_hf(checkpoint, paged_driver):
    hf, path = checkpoint
    model = load_model(str(path), "auto", torch.float32, "cpu").model
    driver = paged_driver(model, block_size=4)
    gen = torch.Generator().manual_seed(1)
    seqs = {name: torch.randint(0, moe_checkpoints.VOCAB, (n,), generator=gen).tolist()
            for name, n in (("a", 19), ("b", 11), ("c", 27))}
    steps = [
        [("a", 0, 13), ("c", 0, 4)],                          # c's first chunk is shorter than the window
        [("c", 4, 21), ("b", 0, 9)],                          # a chunk over cached context, past the window
        [("a", 13, 14), ("b", 9, 10), ("c", 21, 22)],         # batched decode of unequal lengths
        [("a", 14, 15), ("b", 10, 11), ("c", 22, 27)],        # mixed decode and chunk
        *[[("a", 15 + i, 16 + i)] for i in range(4)],
    ]
    reference = {name: _logits(hf, toks) for name, toks in seqs.items()}
    for step in steps:
        outs = driver.step([(name, seqs[name][s:e]) for name, s, e in step])
        for (name, s, e), ours in zip(step, outs):
            err = (ours - reference[name][s:e]).abs().max().item()
            assert err < ATOL, f"{name}[{s}:{e}] max abs error {err:.2e}"


def test_greedy_tokens_through_llm_match_hf_generate(checkpoint):
    from tokenforge import LLM, SamplingParams

    hf, path = checkpoint
    prompts = [list(range(7, 7 + 3 * moe_checkpoints.GPT_OSS_WINDOW)), [5, 90, 17, 200, 3, 41, 41, 8, 120]]
    want = []
    with torch.no_grad():
        for prompt in prompts:
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                              pad_token_id=0)
            want.append(out[0, len(prompt):].tolist())
    with LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=128) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
        stats = llm.get_stats()
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert stats.num_free_blocks == stats.num_kv_blocks


def test_parameter_count_matches_hf(checkpoint):
    hf, path = checkpoint
    arch = load_model(str(path), "auto", torch.float32, "cpu").arch_config
    assert arch.num_parameters() == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("feature", ["sinks", "swiglu_limit", "expert_bias", "router_bias", "yarn"])
def test_gpt_oss_features_change_hf_logits(feature, tmp_path):
    """The parity above can fail: each gpt-oss feature moves HF's own logits far beyond the tolerance."""
    hf, _ = moe_checkpoints.gpt_oss(tmp_path)
    tokens = list(range(3, 40))
    before = _logits(hf, tokens)
    with torch.no_grad():
        for layer in hf.model.layers:
            mlp = layer.mlp
            if feature == "sinks":
                layer.self_attn.sinks.fill_(-1e4)
            elif feature == "swiglu_limit":
                mlp.experts.limit = 1e4
            elif feature == "expert_bias":
                mlp.experts.gate_up_proj_bias.zero_()
            elif feature == "router_bias":
                mlp.router.bias.zero_()
    if feature == "yarn":
        plain = type(hf)(moe_checkpoints.gpt_oss_config(rope_parameters={"rope_type": "default", "rope_theta": 150000.0}))
        plain.load_state_dict(hf.state_dict())
        hf = plain.eval()
    assert (_logits(hf, tokens) - before).abs().max().item() > 100 * ATOL


def test_mxfp4_outside_experts_is_refused_before_loading(tmp_path):
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                                 vocab_size=100)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(ValueError) as info:
        load_model(str(tmp_path), "auto", torch.float32, "cpu")
    assert str(info.value).startswith("unsupported pre-quantized checkpoint: MXFP4 weights outside the experts of a "
                                      "mixture-of-experts model (LlamaForCausalLM)")
