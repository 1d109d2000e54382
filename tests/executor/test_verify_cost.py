"""Executor.verify_cost_ratio, the adaptive rule's start-up calibration, on the CPU: which runners
give a timing (one GPU with CUDA graphs and speculation) and that a failed timing falls back to
the rule's model cost. The timing itself runs on the device (tests/executor/test_gpu_engine.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from tokenforge.executor.executor import Executor


class _Graphs:
    def __init__(self, ratio: float | Exception) -> None:
        self.ratio, self.asked = ratio, []

    def replay_ratio(self, size: int) -> float:
        self.asked.append(size)
        if isinstance(self.ratio, Exception):
            raise self.ratio
        return self.ratio


def _executor(graphs, tp_size: int = 1) -> Executor:
    executor = object.__new__(Executor)
    executor.runner = SimpleNamespace(graphs=graphs, rank=SimpleNamespace(tp_size=tp_size))
    return executor


def test_one_gpu_with_graphs_times_the_verify_bucket():
    graphs = _Graphs(1.8)
    assert _executor(graphs).verify_cost_ratio(16) == 1.8 and graphs.asked == [17]


def test_no_speculation_no_graphs_and_tensor_parallelism_give_none():
    graphs = _Graphs(1.8)
    assert _executor(graphs).verify_cost_ratio(0) is None
    assert _executor(None).verify_cost_ratio(4) is None
    assert _executor(SimpleNamespace()).verify_cost_ratio(4) is None          # the CPU's decode runner
    assert _executor(graphs, tp_size=2).verify_cost_ratio(4) is None         # its graphs hold collectives
    assert graphs.asked == []


def test_a_failed_timing_keeps_the_model_cost(caplog):
    with caplog.at_level(logging.WARNING, logger="tokenforge.executor.executor"):
        assert _executor(_Graphs(RuntimeError("CUDA error: boom"))).verify_cost_ratio(4) is None
    assert "could not time the verify graph (CUDA error: boom)" in caplog.text
