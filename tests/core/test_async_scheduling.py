"""Async scheduling: step N+1 is scheduled before step N's tokens are known (placeholders).

The fake runner reads each context back from its KV slots, so a placeholder filled with the
wrong id, a block freed under a step in flight, or a token lost across a preemption changes the
outputs; every run is compared with the synchronous scheduler and the reference model.
"""

import random

import pytest

from tokenforge.core.outputs import PLACEHOLDER_TOKEN_ID

from .core_fakes import (
    FakeRunner, RunResult, assert_pool_idle, make_request, make_scheduler, record, reference_generate,
    run_async_to_completion, run_to_completion,
)


def workload(seed: int, n: int = 14):
    rng = random.Random(seed)
    shared = [rng.randrange(97) for _ in range(9)]
    work = []
    for i in range(n):
        own = [rng.randrange(97) for _ in range(rng.randrange(1, 20))]
        prompt = shared + own if rng.random() < 0.5 else own
        eos = (rng.randrange(97),) if rng.random() < 0.5 else ()     # some stop early on "EOS"
        work.append((f"r{i}", prompt, rng.randrange(1, 20), eos))
    return work


def run(work, use_async: bool, **kwargs):
    sched = make_scheduler(**kwargs)
    for rid, prompt, max_tokens, eos in work:
        sched.add_request(make_request(rid, prompt, max_tokens=max_tokens, eos=eos))
    res = (run_async_to_completion if use_async else run_to_completion)(sched)
    return res, sched


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_async_outputs_equal_sync_outputs_with_preemption_and_stops(seed, caching):
    work = workload(seed)
    for kwargs in (dict(num_blocks=256), dict(num_blocks=14, max_num_batched_tokens=16)):
        sync, _ = run(work, False, enable_prefix_caching=caching, **kwargs)
        asyn, sched = run(work, True, enable_prefix_caching=caching, **kwargs)
        assert asyn.tokens == sync.tokens and asyn.finish == sync.finish
    assert sched.get_stats().num_preemptions > 0          # the tiny pool did preempt
    for rid, prompt, max_tokens, eos in work:
        ref = reference_generate(prompt, max_tokens)
        if eos and eos[0] in ref:
            ref = ref[:ref.index(eos[0]) + 1]
        assert asyn.tokens[rid] == ref


def test_the_step_ahead_computes_the_in_flight_token_as_a_placeholder():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=3))
    runner, res = FakeRunner(64, 4, sched.kv.pool), RunResult()
    first = sched.schedule()                               # the prefill; samples output 0
    second = sched.schedule()                              # before output 0 is known
    (seq,) = second.sequences
    assert seq.token_ids == [PLACEHOLDER_TOKEN_ID] and seq.start_position == 3 and seq.sample
    out1, out2 = runner.execute(first), runner.execute(second)
    assert sched.schedule().is_empty                       # never two unknown tokens at once
    record(res, sched.update_from_output(first, out1))
    third = sched.schedule()                               # output 1 is in flight
    assert third.sequences[0].token_ids == [PLACEHOLDER_TOKEN_ID]
    out3 = runner.execute(third)
    record(res, sched.update_from_output(second, out2))
    # Output 2 is in flight and max_tokens is 3: nothing more to schedule.
    assert sched.schedule().is_empty
    record(res, sched.update_from_output(third, out3))
    assert res.tokens["a"] == reference_generate([1, 2, 3], 3) and res.finish["a"][0] == "length"
    assert_pool_idle(sched)


def test_a_token_in_flight_for_a_preempted_request_is_kept():
    found = 0
    for seed in range(12):
        work = workload(seed)
        sync, _ = run(work, False, num_blocks=12, max_num_batched_tokens=12)
        sched = make_scheduler(num_blocks=12, max_num_batched_tokens=12)
        for rid, prompt, max_tokens, eos in work:
            sched.add_request(make_request(rid, prompt, max_tokens=max_tokens, eos=eos))
        res = run_async_to_completion(sched)
        assert res.tokens == sync.tokens and res.finish == sync.finish
        found += res.num_preempted_in_flight
    assert found > 0, "no run preempted a request with a token in flight: the test lost its point"


@pytest.mark.parametrize("params", [dict(repetition_penalty=1.2), dict(presence_penalty=0.5),
                                    dict(frequency_penalty=0.5), dict(prompt_logprobs=1)])
def test_requests_that_read_each_step_output_turn_scheduling_ahead_off(params):
    sched = make_scheduler()
    sched.add_request(make_request("plain", [1, 2, 3]))
    assert sched.can_schedule_ahead()
    sched.add_request(make_request("needs", [4, 5, 6], **params))
    assert not sched.can_schedule_ahead()
    sched.abort_requests(["needs"])
    assert sched.can_schedule_ahead()
    sched.add_request(make_request("needs2", [4, 5, 6], max_tokens=2, **params))
    run_to_completion(sched)
    assert sched.can_schedule_ahead()


def test_grammar_requests_keep_scheduling_ahead():
    """The engine defers only the sampling of a step scheduled ahead until its grammar masks are
    filled (engine/structured_output.py): the scheduler need not wait for each step's output."""
    sched = make_scheduler()
    sched.add_request(make_request("constrained", [4, 5, 6], max_tokens=3, grammar='start: "a"'))
    assert sched.can_schedule_ahead()
    res = run_async_to_completion(sched)
    assert len(res.tokens["constrained"]) == 3
