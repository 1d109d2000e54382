"""Greedy parity: tokenforge's token ids equal HF transformers' on the bundled SmolLM2, in
every scheduling mode (one at a time, all at once, chunked prefill, preemption, block sizes,
prefix caching), and the block pool returns to full after each run. The engine runs the GGUF
dequantized to float32 (`dtype="float32"`), HF's own arithmetic; the CPU default computes the
blocks as stored with 8-bit activations and is held to this path in tests/model/test_gguf_native.py."""

from __future__ import annotations

import pytest

from tests.engine.conftest import MAX_NEW, PROMPTS
from tokenforge import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
# Batch 1 runs a sequence's decode steps alone (the weights read once per token, not once per
# batch): a short prompt, CJK, the chat template's special tokens and the ~500-token one cover its
# shapes; every prompt runs batched in each of the other modes.
ONE_AT_A_TIME = (0, 2, 5, 10)


def _run(llm: LLM, hf_greedy, one_at_a_time: bool = False, as_text: bool = False) -> list:
    """`as_text`: PROMPTS go in as text, for the engine's tokenizer, instead of HF's token ids."""
    chosen = ONE_AT_A_TIME if one_at_a_time else range(len(hf_greedy))
    prompts = [PROMPTS[i] if as_text else {"prompt_token_ids": hf_greedy[i][0]} for i in chosen]
    if one_at_a_time:
        outs = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    mismatches = [(i, PROMPTS[i][:30], out.outputs[0].token_ids, hf_greedy[i][1])
                  for i, out in zip(chosen, outs) if out.outputs[0].token_ids != hf_greedy[i][1]]
    assert not mismatches, f"greedy tokens differ from HF: {mismatches}"
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_kv_blocks, "KV blocks leaked"
    assert stats.num_running == 0 and stats.num_waiting == 0
    return outs


@pytest.fixture(scope="module")
def default_llm():
    return LLM(max_num_batched_tokens=2048, dtype="float32")


def test_all_at_once_and_prefix_cache_second_pass(default_llm, hf_reference, hf_greedy):
    """The first pass takes PROMPTS as text: the engine's tokenizer gives HF's ids, and its text is
    HF's decode of the same tokens. The second, as token ids, must hit the prefix cache."""
    tok, _ = hf_reference
    outs = _run(default_llm, hf_greedy, as_text=True)
    for out, (ids, ref) in zip(outs, hf_greedy):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)
    before = default_llm.get_stats()
    _run(default_llm, hf_greedy)
    after = default_llm.get_stats()
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    assert hits >= sum(len(ids) // 16 * 16 - 16 for ids, _ in hf_greedy), hits


def test_one_request_at_a_time(default_llm, hf_greedy):
    _run(default_llm, hf_greedy, one_at_a_time=True)


@pytest.mark.parametrize("kwargs", [
    pytest.param(dict(max_num_batched_tokens=32, enable_prefix_caching=False), id="chunked-prefill-32"),
    pytest.param(dict(num_kv_blocks=48, block_size=16, enable_prefix_caching=False), id="preemption"),
    pytest.param(dict(block_size=1, enable_prefix_caching=False), id="block-size-1"),
    pytest.param(dict(block_size=64), id="block-size-64"),
])
def test_scheduling_modes(kwargs, hf_greedy):
    llm = LLM(dtype="float32", **kwargs)
    _run(llm, hf_greedy)
    if "num_kv_blocks" in kwargs:
        assert llm.get_stats().num_preemptions > 0, "the small pool was meant to force preemption"


def test_logit_bias_matches_hf_sequence_bias(default_llm, hf_reference, hf_greedy):
    """OpenAI's logit_bias, per request in one batch, against HF's `sequence_bias` on single
    tokens (the same addition to the logits): each prompt bans its greedy first token, nudges its
    third by +3 and another by -2, so the continuation changes and every row has its own biases."""
    import torch

    tok, model = hf_reference
    chosen, max_new = (0, 4, 5), 12
    params, want = [], []
    for i in chosen:
        ids, ref = hf_greedy[i]
        bias = {ref[0]: -100.0, ref[2]: 3.0, (ref[1] + 7) % len(tok): -2.0}
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=tok.eos_token_id,
                                 sequence_bias={(t,): b for t, b in bias.items()})
        want.append(out[0, len(ids):].tolist())
        params.append(SamplingParams(temperature=0.0, max_tokens=max_new, logit_bias=bias))
    outs = default_llm.generate([{"prompt_token_ids": hf_greedy[i][0]} for i in chosen], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == want
    assert all(g[0] != hf_greedy[i][1][0] for g, i in zip(got, chosen))     # the ban took
    stats = default_llm.get_stats()
    assert stats.num_free_blocks == stats.num_kv_blocks, "KV blocks leaked"
