"""Executor.verify_cost_ratio, the adaptive rule's start-up calibration, on the CPU: which runners
give a timing (one GPU with CUDA graphs and speculation), what it adds up (the verify of 1 + K rows
and the drafter's graph over a one-row decode), and that a failed timing falls back to the rule's
model cost. The timings themselves run on the device (tests/executor/test_gpu_engine.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tokenforge.executor.executor import Executor
from tokenforge.executor.spec.draft import NoDrafter


class _Graphs:
    def __init__(self, seconds: dict[int, float] | Exception) -> None:
        self.seconds, self.asked = seconds, []

    def replay_seconds(self, size: int) -> float | None:
        self.asked.append(size)
        if isinstance(self.seconds, Exception):
            raise self.seconds
        return self.seconds.get(size)


class _Drafter:
    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds

    def draft_seconds(self, k: int) -> float | None:
        return self.seconds


def _executor(graphs, drafter=None, tp_size: int = 1) -> Executor:
    executor = object.__new__(Executor)
    executor.runner = SimpleNamespace(graphs=graphs, rank=SimpleNamespace(tp_size=tp_size),
                                      drafter=drafter if drafter is not None else NoDrafter())
    executor._verify_costs = {}
    return executor


def test_the_verify_and_the_drafters_graph_over_a_decode():
    graphs = _Graphs({1: 0.5e-3, 17: 0.9e-3})
    assert _executor(graphs).verify_cost_ratio(16) == pytest.approx(1.8) and graphs.asked == [1, 17]
    assert _executor(graphs, _Drafter(0.4e-3)).verify_cost_ratio(16) == pytest.approx(2.6)   # an EAGLE head's graph
    assert _executor(graphs, _Drafter(None)).verify_cost_ratio(16) == pytest.approx(1.8)     # not timed: the verify
    assert _executor(_Graphs({1: 0.5e-3})).verify_cost_ratio(16) is None                    # no verify graph


def test_the_ratio_is_timed_once_per_k():
    """The rule's figure, not a new timing each call (replays vary by a few tenths of a percent)."""
    graphs = _Graphs({1: 0.5e-3, 5: 0.7e-3, 17: 0.9e-3})
    executor = _executor(graphs)
    first = executor.verify_cost_ratio(4)
    graphs.seconds = {1: 0.5e-3, 5: 0.8e-3, 17: 0.9e-3}
    assert executor.verify_cost_ratio(4) == first == pytest.approx(1.4) and graphs.asked == [1, 5]
    assert executor.verify_cost_ratio(16) == pytest.approx(1.8) and graphs.asked == [1, 5, 1, 17]


def test_no_speculation_no_graphs_and_tensor_parallelism_give_none():
    graphs = _Graphs({1: 1.0, 5: 1.3})
    assert _executor(graphs).verify_cost_ratio(0) is None
    assert _executor(None).verify_cost_ratio(4) is None
    assert _executor(SimpleNamespace()).verify_cost_ratio(4) is None          # the CPU's decode runner
    assert _executor(graphs, tp_size=2).verify_cost_ratio(4) is None         # its graphs hold collectives
    assert graphs.asked == []


def test_a_failed_timing_keeps_the_model_cost(caplog):
    with caplog.at_level(logging.WARNING, logger="tokenforge.executor.executor"):
        assert _executor(_Graphs(RuntimeError("CUDA error: boom"))).verify_cost_ratio(4) is None
    assert "could not time the verify graph (CUDA error: boom)" in caplog.text
