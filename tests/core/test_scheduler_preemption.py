import random

import pytest

from .core_fakes import (
    FakeRunner, RunResult, fake_prompt_logprob, make_request, make_scheduler, reference_generate,
    run_to_completion, step,
)


def random_workload(seed: int, n: int = 12) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(97) for _ in range(8)]          # some prompts share a prefix
    work = []
    for i in range(n):
        own = [rng.randrange(97) for _ in range(rng.randrange(1, 14))]
        prompt = shared + own if rng.random() < 0.5 else own
        work.append((f"r{i}", prompt, rng.randrange(1, 16)))
    return work


def run_workload(work, **sched_kwargs) -> tuple[RunResult, int]:
    sched = make_scheduler(**sched_kwargs)
    for rid, prompt, max_tokens in work:
        sched.add_request(make_request(rid, prompt, max_tokens=max_tokens))
    res = run_to_completion(sched)
    return res, sched.get_stats().num_preemptions


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tiny_pool_preempts_and_outputs_stay_token_identical(seed, caching):
    work = random_workload(seed)
    big, big_preemptions = run_workload(work, num_blocks=256, enable_prefix_caching=caching)
    tiny, tiny_preemptions = run_workload(work, num_blocks=10, block_size=4, max_num_batched_tokens=16,
                                          enable_prefix_caching=caching)
    assert big_preemptions == 0 and tiny_preemptions > 0
    assert tiny.tokens == big.tokens and tiny.finish == big.finish
    for rid, prompt, max_tokens in work:
        assert big.tokens[rid] == reference_generate(prompt, max_tokens)


def test_preemption_takes_the_newest_request_and_requeues_it_first():
    sched = make_scheduler(num_blocks=5, block_size=2, max_num_batched_tokens=64)
    runner, res = FakeRunner(5, 2, sched.kv.pool), RunResult()
    sched.add_request(make_request("old", [1, 2, 3, 4], max_tokens=6))
    sched.add_request(make_request("new", [5, 6, 7, 8], max_tokens=6))
    step(sched, runner, res)                    # 2 + 2 of the 5 blocks
    so = step(sched, runner, res)               # both need a 3rd block: "new", the newest, yields
    assert so.preempted_request_ids == ["new"]
    assert [s.request_id for s in so.sequences] == ["old"]
    assert [r.request_id for r in sched.waiting] == ["new"]
    new = sched.requests["new"]
    assert new.num_computed_tokens == 0 and new.status.name == "PREEMPTED"
    assert sched.kv.block_table(new) == []
    run_to_completion(sched, runner, res)
    assert res.tokens["new"] == reference_generate([5, 6, 7, 8], 6)
    assert res.tokens["old"] == reference_generate([1, 2, 3, 4], 6)


def test_a_request_longer_than_the_pool_stops_at_length_instead_of_looping():
    sched = make_scheduler(num_blocks=2, block_size=4, max_model_len=100)   # 8 tokens in all
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=50))
    res = run_to_completion(sched)
    assert len(res.tokens["a"]) == 5 and res.finish["a"] == ("length", None)


def test_prompt_logprobs_are_complete_and_never_duplicated_across_preemption():
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=4)
    runner, res = FakeRunner(5, 4, sched.kv.pool), RunResult()
    sched.add_request(make_request("a", [1, 2, 3, 4, 5, 6], max_tokens=12))
    prompt = list(range(20, 32))
    sched.add_request(make_request("b", prompt, max_tokens=2, prompt_logprobs=1))
    preempted_mid_prefill = False
    while sched.has_unfinished_requests():
        b = sched.requests.get("b")
        emitted = b.num_prompt_logprobs_emitted if b else 0
        so = step(sched, runner, res)
        if "b" in so.preempted_request_ids and 1 < emitted < len(prompt):
            preempted_mid_prefill = True
    assert preempted_mid_prefill
    lps = res.prompt_logprobs["b"]
    assert lps == [fake_prompt_logprob(t) for t in prompt[1:]]   # token 0 has none: not sent
    assert res.tokens["b"] == reference_generate(prompt, 2)
    assert res.num_cached["b"] == 0          # prompt logprobs bypass the prefix cache
