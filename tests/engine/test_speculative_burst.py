"""N-gram bursts (executor/spec/burst.py): the device lookup equals the host's, and an engine
whose lone greedy requests run in bursts emits exactly the tokens it emits without speculation,
stops where it would, and gives every KV block back. The bursts run eagerly here (CPU); the
graphed path is tests/executor/test_gpu_speculative.py's."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.conftest import SPEC_MAX_TOKENS, spec_engine
from tests.engine.conftest import SPEC_PROMPTS as PROMPTS
from tokenforge import LLM, SamplingParams
from tokenforge.executor.spec.burst import DeviceNgram, NoBurst, SpeculativeBurst
from tokenforge.executor.spec.ngram import NgramProposer


def _lookup(ngram_min, ngram_max, hist, length, k, capacity, resync):
    drafts, found = torch.zeros(k, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    DeviceNgram(ngram_min, ngram_max, capacity, resync)(hist, torch.tensor([length, 0, 1]), drafts, found)
    return drafts[:int(found)].tolist()


@pytest.mark.parametrize("resync", [False, True])
@pytest.mark.parametrize("ngram_min,ngram_max,k", [(1, 4, 4), (2, 4, 4), (1, 2, 7), (3, 3, 2)])
def test_device_lookup_equals_the_host_lookup(ngram_min, ngram_max, k, resync):
    rng = random.Random(ngram_min * 100 + ngram_max * 10 + k)
    capacity, host = 96, NgramProposer(ngram_min, ngram_max, resync)
    found = 0
    for trial in range(300):
        length = rng.randint(1, capacity)
        vocab = rng.choice([2, 3, 5, 20, 60])
        history = [rng.randrange(vocab) for _ in range(length)]
        hist = torch.tensor(history + [rng.randrange(50) for _ in range(capacity + k + 1 - length)])
        want = host.propose_one(history, k)
        assert _lookup(ngram_min, ngram_max, hist, length, k, capacity, resync) == want, (trial, history)
        found += bool(want)
    assert 50 < found < 300       # both outcomes were exercised


@pytest.fixture(scope="module")
def burst_llm():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENFORGE_SPEC_BURST", "3")
        llm = spec_engine(speculative_method="ngram", num_speculative_tokens=4)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def plain_llm():
    llm = spec_engine()
    yield llm
    llm.shutdown()


def _ids(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _assert_no_leak(llm):
    kv = llm.get_stats()
    assert kv.num_free_blocks == kv.num_kv_blocks, "KV blocks leaked"
    assert kv.num_running == kv.num_waiting == 0


def test_a_lone_greedy_request_runs_in_bursts_and_emits_the_greedy_tokens(burst_llm, greedy_without_speculation):
    runner = burst_llm.engine.executor.runner
    assert isinstance(runner.burst, SpeculativeBurst) and runner.burst.graph is None     # eager on the CPU
    params = SamplingParams(temperature=0.0, max_tokens=SPEC_MAX_TOKENS, ignore_eos=True)
    drafts = burst_llm.engine.scheduler.drafts
    drafts.reset_counters()
    for i, prompt in enumerate(PROMPTS):
        before = runner.burst.launches
        assert _ids(burst_llm, [prompt], params)[0] == greedy_without_speculation[i], f"prompt {i}"
        assert runner.burst.launches > before
    stats = drafts.stats()
    assert stats["num_accepted_tokens"] > 0 and stats["num_draft_tokens"] >= stats["num_accepted_tokens"]
    per_pos = stats["accepted_per_position"]
    assert sum(per_pos) == stats["num_accepted_tokens"] and per_pos == sorted(per_pos, reverse=True)
    _assert_no_leak(burst_llm)


@pytest.mark.parametrize("max_tokens", [1, 6, 13])
def test_a_burst_stops_where_the_plain_engine_stops(burst_llm, plain_llm, max_tokens):
    """max_tokens inside a burst, EOS (not ignored): the emitted tokens past the stop are dropped,
    and their blocks come back."""
    prompt = PROMPTS[0]
    base = _ids(plain_llm, [prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
    drafts = burst_llm.engine.scheduler.drafts
    drafts.reset_counters()
    assert _ids(burst_llm, [prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0] == base
    # the burst that ends the request is counted (/metrics), as far as the stop: accepted drafts and
    # the one token each verify adds never exceed what was emitted
    stats = drafts.stats()
    assert (stats["num_drafts"] >= 1) == (max_tokens > 1)
    assert stats["num_accepted_tokens"] + stats["num_drafts"] <= len(base)
    _assert_no_leak(burst_llm)


def test_a_burst_stops_at_a_stop_id_and_a_stop_string(burst_llm, plain_llm, greedy_without_speculation):
    """The stops are picked from the plain engine's first 30 greedy tokens (the run's shared
    reference, as above); each stopped run is compared with the plain engine's own."""
    prompt = PROMPTS[0]
    full = greedy_without_speculation[0][:30]
    stop_id = full[9]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id])
    assert _ids(burst_llm, [prompt], params)[0] == _ids(plain_llm, [prompt], params)[0]
    text = plain_llm.get_tokenizer().decode(full)
    stop = text[len(text) // 2: len(text) // 2 + 4]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    want = plain_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    got = burst_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert want.finish_reason == "stop" and len(want.token_ids) < 30      # the stop string was met
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    _assert_no_leak(burst_llm)


@pytest.mark.parametrize("end", ["stop id", "max_tokens"])
def test_a_burst_runs_no_iteration_past_its_stop(burst_llm, greedy_without_speculation, end):
    """The device flag: the last burst's iterations end with the one that emitted the stop id (or the
    last token max_tokens allows); the counters of the iterations after it stay zero. The plain
    engine's first 30 tokens are the run's shared greedy reference's (a lone request's, as above)."""
    prompt = PROMPTS[1]
    full = greedy_without_speculation[1][:30]
    cut = next(i for i in range(4, 30) if full[i] not in full[:i])    # the stop's first occurrence
    extra = {"stop_token_ids": [full[cut]]} if end == "stop id" else {"max_tokens": cut + 1}
    params = SamplingParams(temperature=0.0, ignore_eos=True, **{"max_tokens": 30, **extra})
    assert _ids(burst_llm, [prompt], params)[0] == full[:cut + 1]
    burst = burst_llm.engine.executor.runner.burst
    ran = int(burst.state[1])
    counts = burst.counts.tolist()
    emitted = [a + 1 for a in counts[2:2 + 2 * ran:2]]
    start = int(burst.state[0]) - counts[0]              # the history's length when the burst began
    stop_at = len(prompt_ids(burst_llm, prompt)) + cut + 1   # the history's length once the stop is in
    assert start + sum(emitted[:-1]) < stop_at <= start + sum(emitted), (emitted, start, stop_at)
    assert counts[1 + 2 * ran:] == [0] * (len(counts) - 1 - 2 * ran)
    _assert_no_leak(burst_llm)


def prompt_ids(llm, prompt):
    return llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids


def test_requests_a_burst_cannot_serve_take_the_plain_verify(burst_llm, greedy_without_speculation):
    """Logprobs, penalties, sampling, and a batch of several: no burst, and the same output as
    before bursts (greedy rows equal, one logprobs entry per token)."""
    runner = burst_llm.engine.executor.runner
    before = runner.burst.launches
    out = burst_llm.generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2),
                             use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy_without_speculation[3][:20] and len(out.logprobs) == 20
    burst_llm.generate([PROMPTS[3]], SamplingParams(temperature=0.7, seed=1, max_tokens=12), use_tqdm=False)
    burst_llm.generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.2),
                       use_tqdm=False)
    assert runner.burst.launches == before
    params = SamplingParams(temperature=0.0, max_tokens=SPEC_MAX_TOKENS, ignore_eos=True)
    assert _ids(burst_llm, PROMPTS, params) == greedy_without_speculation      # batches: per-step verify
    _assert_no_leak(burst_llm)


def test_bursts_are_off_unless_asked_for_on_the_cpu(plain_llm, monkeypatch):
    monkeypatch.delenv("TOKENFORGE_SPEC_BURST", raising=False)
    llm = spec_engine(speculative_method="ngram", num_speculative_tokens=2)
    try:
        assert isinstance(llm.engine.executor.runner.burst, NoBurst)
        assert llm.engine.scheduler.drafts.burst_slots == 0
    finally:
        llm.shutdown()


def test_the_device_replay_drafts_the_continuation_at_the_chosen_acceptance():
    """bench/lib/replay_device.py: acceptance 1 drafts the continuation, 0 misses every token, the
    count stops at the end of what is known, and a launch learns the tokens emitted so far."""
    from tokenforge.bench.lib.replay import ReplayDrafter
    from tokenforge.bench.lib.replay_device import DeviceReplay

    prompt, cont = [5, 6, 7], [8, 9, 10, 11, 12, 13]
    cpu = torch.device("cpu")
    hist = torch.zeros(37, dtype=torch.long)

    def draft(replay, length):
        drafts, found = torch.zeros(4, dtype=torch.long), torch.zeros(1, dtype=torch.long)
        replay(hist, torch.tensor([length, 0, 1]), drafts, found)
        return drafts.tolist(), int(found)

    sure = DeviceReplay(ReplayDrafter([prompt], [list(cont)], 1.0, 100), 4, 32, cpu)
    sure.begin(prompt + [8, 3])                 # the engine emitted 8, then 3 where the guess was 9
    assert draft(sure, 5) == ([10, 11, 12, 13], 4)
    assert sure.host.continuations([prompt])[0][:2] == [8, 3]
    drafts, count = draft(sure, 7)
    assert drafts[:2] == [12, 13] and count == 2
    never = DeviceReplay(ReplayDrafter([prompt], [list(cont)], 0.0, 100), 4, 32, cpu)
    never.begin(prompt)
    assert draft(never, 3)[0] == [7, 8, 9, 10]  # every token one below the continuation's
    never.begin([1, 2])                         # no known prompt: nothing to draft
    assert draft(never, 2)[1] == 0 and never.host.num_unknown == 1


def test_a_burst_near_the_length_cap_and_a_full_kv_cache_stays_exact(plain_llm, monkeypatch):
    """A burst's slots capped by the context length (the request ends at max_model_len), in a large
    cache and in one of exactly the sequence's blocks: the plain engine's output, no preemption."""
    long_prompt = {"prompt_token_ids": ([11, 22, 33, 44, 55, 66, 77] * 40)[:232]}
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    # the plain engine's first 24 tokens: what a 256-token context leaves after the prompt
    want = plain_llm.generate([long_prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    assert want.finish_reason == "length" and len(want.token_ids) == 24       # 256 - 232
    monkeypatch.setenv("TOKENFORGE_SPEC_BURST", "3")
    for blocks in (64, 16):             # 16 blocks x 16 = 256 slots: one block free past the prompt
        llm = LLM(None, num_kv_blocks=blocks, max_model_len=256, block_size=16, dtype="float32",
                  speculative_method="ngram", num_speculative_tokens=4)
        try:
            got = llm.generate([long_prompt], params, use_tqdm=False)[0].outputs[0]
            assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), blocks
            assert llm.engine.executor.runner.burst.launches > 0
            assert llm.get_stats().num_preemptions == 0
            _assert_no_leak(llm)
        finally:
            llm.shutdown()
