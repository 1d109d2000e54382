"""The offline API on the bundled model: input shapes, sampling features, bad inputs (the engine
stays usable and the pool returns to full), logprobs and chat."""

from __future__ import annotations

import math

import pytest

from tokenforge import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=1024)


def _assert_idle(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_kv_blocks and stats.num_running == stats.num_waiting == 0


def test_prompt_forms_give_the_same_greedy_output(llm):
    params = SamplingParams(temperature=0, max_tokens=8)
    ids = llm.tokenizer.encode("The capital of France is")
    by_text = llm.generate("The capital of France is", params, use_tqdm=False)[0]
    by_ids = llm.generate([ids], params, use_tqdm=False)[0]
    by_dict = llm.generate([{"prompt_token_ids": ids}], [params], use_tqdm=False)[0]
    assert by_text.prompt == "The capital of France is" and by_text.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == by_dict.outputs[0].token_ids
    assert by_text.outputs[0].finish_reason == "length" and len(by_text.outputs[0].token_ids) == 8


@pytest.mark.parametrize("prompt,needle", [
    ("", "prompt is empty"),
    ([], "prompt is empty"),
    ([1, 2, 10**6], "outside the vocabulary"),
    ([-1], "outside the vocabulary"),
    ("word " * 1100, "max_model_len is 1024"),
])
def test_bad_prompts_raise_and_leave_the_engine_usable(llm, prompt, needle):
    good = "Hello there"
    with pytest.raises(ValueError, match=needle):
        llm.generate([good, prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    _assert_idle(llm)
    out = llm.generate(good, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    _assert_idle(llm)


def test_too_long_prompt_names_both_lengths(llm):
    ids = [100] * 2000
    with pytest.raises(ValueError, match=r"2000 tokens long.*max_model_len is 1024"):
        llm.generate([ids], use_tqdm=False)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"), (dict(top_k=-2), "top_k"), (dict(n=0), "n must"),
    (dict(max_tokens=0), "max_tokens"), (dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(logprobs=-1), "logprobs"), (dict(prompt_logprobs=True), "prompt_logprobs"),
    (dict(logit_bias={"x": 1}), "logit_bias keys"), (dict(logit_bias={-1: 1}), "logit_bias keys"),
    (dict(logit_bias={5: 101}), "logit_bias values"), (dict(logit_bias={5: float("nan")}), "logit_bias values"),
    (dict(logit_bias=[5]), "logit_bias must"),
])
def test_invalid_sampling_params(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_max_logprobs_caps_what_a_request_may_ask_for(llm):
    """vLLM's max_logprobs: 20 by default (21 is refused naming it, the engine stays usable); an
    engine started with 30 (tiny-llama, dummy weights) returns 30 alternatives a token, the
    sampled one's among them; -2 is refused before anything loads."""
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{name} is 21, above the engine's max_logprobs 20"):
            llm.generate("Hello", SamplingParams(max_tokens=2, **{name: 21}), use_tqdm=False)
    _assert_idle(llm)
    with pytest.raises(ValueError, match="max_logprobs must be >= 0, or -1"):
        LLM(max_logprobs=-2)
    wide = LLM("tiny-llama", load_format="dummy", dtype="float32", max_model_len=128, max_logprobs=30)
    try:
        out = wide.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, logprobs=30), use_tqdm=False)[0]
        tokens, entries = out.outputs[0].token_ids, out.outputs[0].logprobs
        assert len(entries) == 3 and all(len(e) >= 30 and t in e for t, e in zip(tokens, entries))
    finally:
        wide.shutdown()


def test_params_list_must_match_prompts(llm):
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_seeded_sampling_is_reproducible_across_batches(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    alone = llm.generate("Tell me a story about a cat", seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12)
    batch = llm.generate(["Hi", "Tell me a story about a cat", "Numbers: 1 2 3"], [others, seeded, others],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_n_parallel_samples(llm):
    out = llm.generate("Once upon a time", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "parallel samples should differ"
    _assert_idle(llm)


def test_logprobs_and_prompt_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2)
    out = llm.generate("The capital of France is", params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 5
    for tok, entry in zip(completion.token_ids, completion.logprobs):
        assert tok in entry and entry[tok].rank == 1          # greedy picks the top token
        assert 3 <= len(entry) <= 4 and all(lp.logprob <= 0 for lp in entry.values())
        assert isinstance(entry[tok].decoded_token, str)
    assert math.isclose(completion.cumulative_logprob, sum(e[t].logprob for t, e in
                                                           zip(completion.token_ids, completion.logprobs)))
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
    for tok, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert tok in entry


def test_stop_strings_and_stop_tokens(llm):
    base = llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    text = base.outputs[0].text
    stop = text[3:6]
    assert stop and stop in text
    out = llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=16, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)] and stop not in out.text
    first = base.outputs[0].token_ids[2]
    out = llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[first]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == first and out.stop_reason == first
    _assert_idle(llm)


def test_min_tokens_and_ignore_eos(llm):
    eos = llm.tokenizer.eos_token_ids[0]
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=40, min_tokens=30), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 30 and eos not in out.outputs[0].token_ids[:30]
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 40 and out.outputs[0].finish_reason == "length"


def test_penalties_change_greedy_output(llm):
    prompt = "apple apple apple apple apple"
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    penalized = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, repetition_penalty=2.0,
                                                    frequency_penalty=1.0), use_tqdm=False)[0]
    assert plain.outputs[0].token_ids != penalized.outputs[0].token_ids


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0, max_tokens=8),
                   use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>") and out.prompt.endswith("<|im_start|>assistant\n")
    assert out.outputs[0].token_ids


def test_chat_continues_the_final_message_and_passes_template_kwargs(llm):
    """vLLM's LLM.chat keywords: continue_final_message ends the prompt where the assistant's partial
    answer does (with add_generation_prompt it is an error), chat_template_kwargs are taken, and so is
    lora_request (None: the base model)."""
    messages = [{"role": "user", "content": "Name the capital of France."},
                {"role": "assistant", "content": "The capital of France is"}]
    params = SamplingParams(temperature=0, max_tokens=4)
    out = llm.chat(messages, params, use_tqdm=False, lora_request=None, add_generation_prompt=False,
                   continue_final_message=True)[0]
    assert out.prompt.endswith("<|im_start|>assistant\nThe capital of France is")
    assert out.outputs[0].token_ids == llm.generate([out.prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="Cannot set both `continue_final_message` and `add_generation_prompt`"):
        llm.chat(messages, params, continue_final_message=True)
    plain = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)[0]
    kwargs = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False,
                      chat_template_kwargs={"enable_thinking": False})[0]       # a variable this template ignores
    assert kwargs.prompt == plain.prompt


def test_missing_model_and_unknown_architecture(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text('{"architectures": ["GPTNeoXForCausalLM"], "hidden_size": 8}')
    with pytest.raises(ValueError, match="no vocab_size"):
        LLM(str(tmp_path), load_format="dummy")
    (tmp_path / "config.json").write_text(
        '{"architectures": ["GPTNeoXForCausalLM"], "hidden_size": 8, "vocab_size": 32}')
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(str(tmp_path), load_format="dummy")
