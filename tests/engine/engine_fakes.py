"""Test doubles for the engine core's step timing: an executor over tests/core's fake runner.

`FakeExecutor` runs each step when it is launched (in launch order, as the device would) and
logs every call, so a test reads the order of launches, samplings and collects. `FakeGrammars`
stands in for the llguidance matchers: the requests it names are "constrained", and it logs
fills and advances.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from tests.core.core_fakes import VOCAB, FakeRunner
from tokenforge.config import EngineConfig
from tokenforge.core.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, SchedulerOutput
from tokenforge.engine import engine_core
from tokenforge.engine.engine_core import EngineCore
from tokenforge.executor.graph_stages import StagedCapture


@dataclass
class FakeHandle:
    step: int
    sched: SchedulerOutput
    output: ModelRunnerOutput
    deferred: bool


@dataclass
class FakeExecutor:
    num_blocks: int
    block_size: int
    is_async_device: bool = False
    tokens_per_step: int = 1
    events: list[tuple] = field(default_factory=list)
    vocab_size: int = VOCAB
    arch: object = field(default_factory=lambda: SimpleNamespace(max_position_embeddings=4096))
    graph_sizes: tuple[int, ...] = ()        # CUDA-graph buckets (graph_stages.StagedCapture, a fake capture)
    capture_check: object = None             # called with each bucket as it is captured

    def __post_init__(self) -> None:
        self.runner = FakeRunner(self.num_blocks, self.block_size, tokens_per_step=self.tokens_per_step)
        self._ids = itertools.count(1)
        self.in_flight: list[FakeHandle] = []
        self.max_in_flight = 0
        self.tiers = None
        self.graphs = None
        self.decode_buckets: list[int | None] = []

    def init_kv_cache(self, config: EngineConfig, defer_graphs: bool = False) -> int:
        self.graphs = None
        if self.graph_sizes:
            self.graphs = StagedCapture(self.graph_sizes, self._capture_one, defer_graphs)
            self.graphs.capture_initial()
        return self.num_blocks

    def _capture_one(self, size: int) -> None:
        if self.capture_check is not None:
            self.capture_check(size)
        self.events.append(("capture", size))

    def capture_deferred_graph(self) -> bool:
        return self.graphs is not None and self.graphs.capture_next()

    def graph_counts(self) -> tuple[int, int]:
        return (len(self.graphs.pending), self.graphs.eager_decode_steps) if self.graphs else (0, 0)

    def verify_cost_ratio(self, num_draft_tokens: int) -> float | None:
        return None

    def launch(self, sched: SchedulerOutput, defer_sampling: bool = False) -> FakeHandle:
        assert not any(h.deferred for h in self.in_flight), "launched before the deferred step was sampled"
        if self.graphs is not None and sched.sequences and all(len(q.token_ids) == 1 for q in sched.sequences):
            self.decode_buckets.append(self.graphs.bucket(len(sched.sequences)))     # None: ran eagerly
        handle = FakeHandle(next(self._ids), sched, self.runner.execute(sched), defer_sampling)
        self.events.append(("launch", handle.step, defer_sampling))
        self.in_flight.append(handle)
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        return handle

    def sample(self, handle: FakeHandle, sched: SchedulerOutput) -> None:
        assert handle.deferred, "sampled twice"
        handle.deferred = False
        self.events.append(("sample", handle.step))

    def collect(self, handle: FakeHandle) -> ModelRunnerOutput:
        assert not handle.deferred, "collected before it was sampled"
        assert self.in_flight[0] is handle, "collected out of launch order"
        self.in_flight.pop(0)
        self.events.append(("collect", handle.step))
        return handle.output

    def grammar_bitmask_buffer(self, rows: int, width: int) -> np.ndarray:
        return np.zeros((rows, width), dtype=np.int32)

    def submit_kv_transfers(self, sched: SchedulerOutput) -> None:
        pass

    def allocator_fragmentation(self) -> float:
        return 0.0

    def kv_tier_stats(self):
        return None

    def shutdown(self) -> None:
        pass


class FakeGrammars:
    """The engine's GrammarMatchers, for the requests in `constrained`: fills and advances logged."""

    def __init__(self, constrained: set[str], events: list[tuple]) -> None:
        self.constrained, self.events = constrained, events
        self.consumed: dict[str, list[int]] = {rid: [] for rid in constrained}

    def __len__(self) -> int:
        return len(self.constrained)

    def waits_for_tokens(self, sched: SchedulerOutput) -> bool:
        return any(s.sample and s.token_ids[-1] == PLACEHOLDER_TOKEN_ID and s.request_id in self.constrained
                   for s in sched.sequences)

    def fill(self, sched: SchedulerOutput, buffer=None) -> None:
        rows = [s.request_id for s in sched.sequences if s.sample and s.request_id in self.constrained]
        if rows:
            self.events.append(("fill", tuple(rows)))

    def advance(self, sched: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        for s in sched.sequences:
            if s.request_id in self.constrained and s.request_id in runner_output.sampled_token_ids:
                self.consumed[s.request_id].extend(runner_output.sampled_token_ids[s.request_id])
                self.events.append(("advance", s.request_id))

    def forget_finished(self, outputs) -> None:
        for out in outputs:
            if out.finished:
                self.constrained.discard(out.request_id)

    def add(self, request_id: str, grammar: str) -> None:
        pass

    def remove(self, request_ids) -> None:
        pass


def make_engine(monkeypatch, *, is_async_device: bool = False, async_scheduling: bool | None = None,
                pipeline_steps: int = 1, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 4,
                max_num_batched_tokens: int = 32, tokens_per_step: int = 1, defer_graphs: bool = True,
                **executor_fields) -> EngineCore:
    """An EngineCore over a FakeExecutor (no model, no tokenizer); `executor_fields` go to it."""
    layout = {"pipeline_parallel_size": 2, "pipeline_steps": pipeline_steps} if pipeline_steps > 1 else {}
    config = EngineConfig.from_kwargs(
        model="tiny-llama", load_format="dummy", device="cpu", num_kv_blocks=num_blocks, block_size=block_size,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=256,
        async_scheduling=async_scheduling, **layout)
    executor = FakeExecutor(num_blocks, block_size, is_async_device, tokens_per_step, **executor_fields)
    monkeypatch.setattr(engine_core, "create_executor", lambda cfg: executor)
    engine = EngineCore(config, tokenizer=object(), defer_graphs=defer_graphs)
    executor.runner.pool = engine.scheduler.kv.pool      # writes must hit private blocks
    return engine


def run_engine(engine: EngineCore, max_steps: int = 10_000) -> dict[str, list[int]]:
    """Step until nothing is left, as LLM does; returns each request's tokens."""
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert out.request_id not in finished, "output after the request finished"
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished.add(out.request_id)
    else:
        raise AssertionError("the engine made no progress")
    engine.drain()
    return tokens
