"""Pipelined steps (pipeline parallelism): up to K steps in flight, over disjoint requests.

The loop below is EngineCore's pipelined step: schedule (and run, as the device would, in launch
order) until K steps are in flight, then update the oldest. The fake runner reads each context
back from its KV slots, so a block freed under a step in flight, a request in two steps at once
or a token lost across a preemption changes the outputs; every run is compared with the
synchronous scheduler and the reference model.
"""

from collections import deque

import pytest

from tokenforge.core.outputs import PLACEHOLDER_TOKEN_ID

from .core_fakes import (FakeRunner, RunResult, assert_pool_idle, make_request, make_scheduler, record,
                         reference_generate, run_to_completion)
from .test_async_scheduling import workload


def run_pipelined_to_completion(sched, max_steps: int = 10_000):
    """Returns (result, the most steps in flight at once)."""
    runner, result = FakeRunner(sched.num_kv_blocks, sched.block_size, sched.kv.pool), RunResult()
    pipeline, most = deque(), 0
    for _ in range(max_steps):
        if not pipeline and not sched.has_unfinished_requests():
            break
        while len(pipeline) < sched.pipeline_steps:
            so = sched.schedule()
            if not so.sequences:
                break
            ids = [s.request_id for s in so.sequences]
            assert len(ids) == len(set(ids)) and len(ids) <= sched.config.max_num_seqs
            in_flight = {s.request_id for done, _ in pipeline for s in done.sequences}
            assert in_flight.isdisjoint(ids), "a request in two steps in flight"
            assert all(PLACEHOLDER_TOKEN_ID not in s.token_ids for s in so.sequences)
            assert so.total_num_tokens <= sched.config.max_num_batched_tokens
            pipeline.append((so, runner.execute(so)))
        most = max(most, len(pipeline))
        if pipeline:
            so, out = pipeline.popleft()
            record(result, sched.update_from_output(so, out))
            result.steps.append(so)
    else:
        raise AssertionError("the scheduler made no progress")
    assert_pool_idle(sched)
    return result, most


def submit(sched, work):
    for rid, prompt, max_tokens, eos in work:
        sched.add_request(make_request(rid, prompt, max_tokens=max_tokens, eos=eos))
    return sched


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_pipelined_outputs_equal_sync_outputs_with_preemption_and_stops(seed, caching):
    work = workload(seed)
    preempted = 0
    for kwargs in (dict(num_blocks=256), dict(num_blocks=14, max_num_batched_tokens=16)):
        sync = run_to_completion(submit(make_scheduler(enable_prefix_caching=caching, **kwargs), work))
        for k in (2, 3):
            sched = submit(make_scheduler(enable_prefix_caching=caching, pipeline_steps=k, **kwargs), work)
            piped, most = run_pipelined_to_completion(sched)
            assert piped.tokens == sync.tokens and piped.finish == sync.finish
            assert most == k                                   # the steps in flight did fill up
            preempted += sched.get_stats().num_preemptions
    assert preempted > 0                                       # the tiny pool did preempt
    for rid, prompt, max_tokens, eos in work:
        ref = reference_generate(prompt, max_tokens)
        assert sync.tokens[rid] == (ref[:ref.index(eos[0]) + 1] if eos and eos[0] in ref else ref)


def test_each_step_takes_its_share_and_a_request_in_flight_waits_for_its_step():
    sched = make_scheduler(pipeline_steps=2, max_num_batched_tokens=64)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", [i + 1] * 3, max_tokens=4))
    sched.add_request(make_request("long", list(range(1, 81)), max_tokens=2))   # 80 tokens: chunked
    runner = FakeRunner(64, 4, sched.kv.pool)
    a = sched.schedule()
    b = sched.schedule()
    ids_a, ids_b = [s.request_id for s in a.sequences], [s.request_id for s in b.sequences]
    assert ids_a == ["r0", "r1", "r2"] and ids_b == ["r3", "r4", "long"]     # 6 requests, 3 per step
    assert b.sequences[-1].num_tokens == 64 - 6 and not b.sequences[-1].sample   # a chunk of "long"
    assert sched.schedule().is_empty                       # every request is in a step in flight
    out_a, out_b = runner.execute(a), runner.execute(b)
    res = RunResult()
    record(res, sched.update_from_output(a, out_a))
    c = sched.schedule()                                   # A's requests again; "long" still in B
    assert [s.request_id for s in c.sequences] == ids_a
    record(res, sched.update_from_output(b, out_b))
    d = sched.schedule()
    assert [s.request_id for s in d.sequences] == ["r3", "r4", "long"]
    assert d.sequences[-1].start_position == 58            # the rest of the chunked prompt
    sched.abort_requests(["r0", "r3"])                     # in flight (C) and in flight (D)
    record(res, sched.update_from_output(c, runner.execute(c)))
    record(res, sched.update_from_output(d, runner.execute(d)))
    assert len(res.tokens["r0"]) == len(res.tokens["r3"]) == 1     # nothing after the abort
    assert not sched._busy                                 # noqa: SLF001 - every step is back
    sched.abort_requests(list(sched.requests))
    assert_pool_idle(sched)
