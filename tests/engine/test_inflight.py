"""The engine's step timing (engine/inflight.py) against a fake executor: one loop, three depths.

`EngineCore.step()` fills the in-flight queue and finishes the oldest step. Synchronous engines
keep one step in flight, async scheduling two (the next launched before the previous is collected,
reading its placeholder), pipelined steps K over disjoint requests. Each run must give the fake
model's reference tokens and leave the KV pool full.
"""

from __future__ import annotations

import pytest

from tests.core.core_fakes import assert_pool_idle, make_request, reference_generate
from tests.engine.engine_fakes import FakeGrammars, make_engine, run_engine
from tokenforge.engine.inflight import InFlightQueue, LaunchedStep

PROMPTS = {f"r{i}": [3 + i, 5, 7 + 2 * i, 11][: 2 + i % 3] * (1 + i % 2) for i in range(7)}


def _submit(engine, max_tokens: int = 6, **params) -> None:
    for rid, prompt in PROMPTS.items():
        engine.add_request(make_request(rid, prompt, max_tokens=max_tokens, **params))


def _expected(max_tokens: int = 6) -> dict[str, list[int]]:
    return {rid: reference_generate(p, max_tokens) for rid, p in PROMPTS.items()}


def _order(events, kind):
    return [e[1] for e in events if e[0] == kind]


def test_queue_depths_follow_the_step_timing():
    assert InFlightQueue.for_engine(1, False).depth == 1
    assert InFlightQueue.for_engine(1, True).depth == 2 and InFlightQueue.for_engine(1, True).is_async
    pipelined = InFlightQueue.for_engine(3, True)
    assert pipelined.depth == 3 and pipelined.is_pipelined and not pipelined.is_async


def test_a_step_ahead_needs_the_schedulers_leave_and_room():
    q = InFlightQueue(2, reads_placeholders=True)
    asked = []
    allow = lambda: asked.append(1) or False  # noqa: E731
    assert q.can_launch(allow) and not asked, "the first step needs no leave"
    q.push(LaunchedStep(None, 1))
    assert q.launches_ahead and not q.can_launch(allow) and asked == [1]
    assert q.can_launch(lambda: True)
    q.push(LaunchedStep(None, 2))
    assert not q.can_launch(lambda: True) and q.max_in_flight == 2
    assert q.pop_oldest().handle == 1 and q.oldest().handle == 2
    pipelined = InFlightQueue(3, reads_placeholders=False)
    pipelined.push(LaunchedStep(None, 1))
    assert not pipelined.launches_ahead and pipelined.can_launch(lambda: False)


def test_synchronous_steps_finish_before_the_next_launch(monkeypatch):
    engine = make_engine(monkeypatch)
    assert not engine.async_scheduling and engine.in_flight.depth == 1
    _submit(engine)
    assert run_engine(engine) == _expected()
    events = engine.executor.events
    assert all(a[0] == "launch" and b == ("collect", a[1]) for a, b in zip(events[::2], events[1::2]))
    assert engine.executor.max_in_flight == 1 and engine.max_steps_in_flight == 0
    assert_pool_idle(engine.scheduler)


def test_async_scheduling_launches_the_next_step_before_collecting(monkeypatch):
    engine = make_engine(monkeypatch, is_async_device=True)
    assert engine.async_scheduling and engine.in_flight.depth == 2
    _submit(engine)
    assert run_engine(engine) == _expected()       # placeholders read the step in flight's ids
    ex = engine.executor
    assert ex.max_in_flight == 2 and engine.max_steps_in_flight == 0
    assert _order(ex.events, "collect") == sorted(_order(ex.events, "collect"))
    # Step N+1 is launched before step N is collected, from the second step on.
    launches = [i for i, e in enumerate(ex.events) if e[0] == "launch"]
    collects = {e[1]: i for i, e in enumerate(ex.events) if e[0] == "collect"}
    assert sum(launches[n] < collects[n] for n in range(1, len(launches))) >= len(launches) - 3
    assert_pool_idle(engine.scheduler)


def test_a_request_that_needs_each_output_keeps_steps_synchronous(monkeypatch):
    """Penalties read the output history: no step is scheduled ahead while such a request runs."""
    engine = make_engine(monkeypatch, is_async_device=True)
    _submit(engine, repetition_penalty=1.2)
    assert run_engine(engine) == _expected()
    assert engine.executor.max_in_flight == 1


def test_the_step_timing_can_change_between_runs(monkeypatch):
    engine = make_engine(monkeypatch, is_async_device=True)
    engine.async_scheduling = False
    _submit(engine)
    assert run_engine(engine) == _expected() and engine.executor.max_in_flight == 1


@pytest.mark.parametrize("k", [2, 3])
def test_pipelined_steps_keep_k_in_flight_over_disjoint_requests(monkeypatch, k):
    engine = make_engine(monkeypatch, pipeline_steps=k, max_num_seqs=3)
    assert engine.in_flight.is_pipelined and engine.in_flight.depth == k
    _submit(engine)
    ex = engine.executor
    real_launch = ex.launch

    def launch(sched, defer_sampling=False):
        busy = {s.request_id for h in ex.in_flight for s in h.sched.sequences}
        assert not busy & {s.request_id for s in sched.sequences}, "a request in two steps in flight"
        assert not defer_sampling
        return real_launch(sched, defer_sampling)

    ex.launch = launch
    assert run_engine(engine) == _expected()
    assert engine.max_steps_in_flight == ex.max_in_flight == k
    assert_pool_idle(engine.scheduler)


def test_a_deferred_step_is_sampled_after_the_step_before_is_collected(monkeypatch):
    """Async scheduling with grammar rows: the step ahead is launched with its sampling deferred;
    it is sampled once the step before is collected and its tokens advanced the grammar, before
    any other launch."""
    engine = make_engine(monkeypatch, is_async_device=True)
    ex = engine.executor
    engine.grammars = FakeGrammars({"r1", "r4"}, ex.events)
    _submit(engine)
    assert run_engine(engine) == _expected()
    events = ex.events
    deferred = [e[1] for e in events if e[0] == "launch" and e[2]]
    assert len(deferred) >= 4 and _order(events, "sample") == deferred
    for n in deferred:
        at = events.index(("sample", n))
        # collect(n-1), the advance(s) of its grammar rows, the fill of n's masks, then sample(n)
        before = events[events.index(("collect", n - 1)):at]
        assert before[0] == ("collect", n - 1) and before[-1][0] == "fill"
        assert all(e[0] in ("advance", "fill") for e in before[1:])
        next_launch = [i for i, e in enumerate(events) if e[0] == "launch" and e[1] == n + 1]
        assert not next_launch or next_launch[0] > at, "launched before the deferred step was sampled"
    assert engine.grammars.consumed["r1"] == _expected()["r1"]


def test_drain_samples_a_deferred_step_before_collecting_it(monkeypatch):
    """After an error a step launched ahead may still wait for its masks: drain samples it first."""
    engine = make_engine(monkeypatch, is_async_device=True)
    ex = engine.executor
    engine.grammars = FakeGrammars({"r0"}, ex.events)
    engine.add_request(make_request("r0", [1, 2, 3], max_tokens=8))
    engine.step()
    engine.step()
    assert len(engine.in_flight) == 1
    real_collect = ex.collect

    def failing_collect(handle):
        ex.in_flight.remove(handle)              # that step is lost with the error
        raise RuntimeError("device error")

    ex.collect = failing_collect
    with pytest.raises(RuntimeError, match="device error"):
        engine.step()
    waiting = engine.in_flight.oldest()
    assert waiting is not None and waiting.awaits_masks
    ex.collect = real_collect
    engine.abort_requests(["r0"])
    engine.drain()
    assert not engine.in_flight and ("sample", waiting.handle.step) in ex.events
