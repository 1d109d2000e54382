"""EngineCore: schedule -> execute -> update, one step at a time.

In: EngineCoreRequests and aborts. Out: EngineCoreOutputs (token ids, logprobs, finish reasons)
and EngineStats. It owns the scheduler (policy, no torch) and the executor (the model). It runs
in-process for the offline `LLM`, and in its own process behind the server.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque

from tokenforge.config import EngineConfig
from tokenforge.core.outputs import SchedulerOutput
from tokenforge.core.scheduler import Scheduler
from tokenforge.engine.structured_output import GrammarMatchers
from tokenforge.engine.tokenization import load_engine_tokenizer
from tokenforge.executor.factory import create_executor
from tokenforge.messages import EngineCoreOutput, EngineCoreRequest, EngineStats

logger = logging.getLogger(__name__)


def resolve_max_model_len(requested: int | None, model_limit: int) -> int:
    if requested is None:
        return model_limit
    if requested > model_limit:
        raise ValueError(f"max_model_len {requested} is larger than the model's context limit "
                         f"(max_position_embeddings = {model_limit})")
    return requested


def startup_phases(executor_s: float, kv_s: float, executor) -> dict[str, float]:
    """Where start-up time went: since process start (imports), loading (workers and weights),
    KV profiling and allocation, CUDA graph capture."""
    runner = executor.runner
    graphs = getattr(getattr(runner, "graphs", None), "capture_seconds", 0.0) or 0.0
    phases = {"before_engine": _seconds_since_process_start() - executor_s - kv_s,
              "load": executor_s, "kv_cache": kv_s - graphs, "cuda_graphs": graphs}
    phases["total"] = sum(phases.values())
    return phases


def _seconds_since_process_start() -> float:
    """Linux: this process's age from /proc (start time in clock ticks after boot); else 0."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class EngineCore:
    def __init__(self, config: EngineConfig, tokenizer=None) -> None:
        t0 = time.perf_counter()
        self.executor = create_executor(config)
        t1 = time.perf_counter()
        arch = self.executor.arch
        self.config = config.with_max_model_len(
            resolve_max_model_len(config.model.max_model_len, arch.max_position_embeddings))
        self.num_kv_blocks = self.executor.init_kv_cache(self.config)
        self.startup_phases = startup_phases(t1 - t0, time.perf_counter() - t1, self.executor)
        logger.info("start-up: %s", ", ".join(f"{k} {v:.2f} s" for k, v in self.startup_phases.items()))
        self.scheduler = Scheduler(self.config.scheduler, self.config.cache, self.num_kv_blocks)
        if self.scheduler.tiers is not None:
            self.executor.init_kv_tiers(self.config)
        mode = self.config.scheduler.async_scheduling
        # Auto: on where launches are asynchronous (CUDA); on the CPU a launch runs the model.
        self.async_scheduling = mode if mode is not None else self.executor.is_async_device
        self._in_flight: tuple[SchedulerOutput, object] | None = None
        # The step launched ahead whose sampling waits for its grammar masks (async scheduling):
        # queued by `finish_step` of the step before it, once that step's tokens are known.
        self._awaiting_masks: tuple[SchedulerOutput, object] | None = None
        # Pipeline parallelism: up to `pipeline_steps` steps in flight, oldest first, each over
        # requests no other one holds (the scheduler keeps them apart); no placeholders.
        self.pipeline_steps = self.config.scheduler.pipeline_steps
        self._pipeline: deque[tuple[SchedulerOutput, object]] = deque()
        self.max_steps_in_flight = 0
        model, load_format = self.config.model.model, self.config.load.load_format
        self.grammars = GrammarMatchers(lambda: tokenizer or load_engine_tokenizer(model, load_format),
                                        self.vocab_size)

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.executor.vocab_size

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.params.grammar is not None:
            self.grammars.add(request.request_id, request.params.grammar)
        try:
            self.scheduler.add_request(request)
        except ValueError:
            self.grammars.remove([request.request_id])
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.scheduler.abort_requests(request_ids)
            self.grammars.remove(request_ids)

    def step(self) -> list[EngineCoreOutput]:
        """Run the engine one step; returns the outputs of the step that completed.

        With async scheduling, the next step is scheduled and queued on the device before this
        one's results are read back, so the host work of both (scheduling, input building,
        output processing by the caller) runs while the device computes. Grammar requests keep
        this: a step whose masks need the tokens of the step in flight is launched with its
        sampling deferred, and `finish_step` samples it once those tokens are in. Under pipeline
        parallelism up to `pipeline_steps` steps over disjoint requests are in flight instead.
        """
        if self.pipeline_steps > 1:
            return self._step_pipelined()
        if not self.async_scheduling:
            return self.finish_step(self.launch_step())
        if self._in_flight is None:
            self._in_flight = self._launch_if_any()
            if self._in_flight is None:
                return []
        ahead = self._launch_if_any(ahead=True) if self.scheduler.can_schedule_ahead() else None
        done, self._in_flight = self._in_flight, ahead
        return self.finish_step(done)

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        """Fill the pipeline up to `pipeline_steps` steps, then finish the oldest. The first stage
        queues each new step's layers while the later stages still run the older steps."""
        pipeline = self._pipeline
        while len(pipeline) < self.pipeline_steps:
            launched = self._launch_if_any()
            if launched is None:
                break
            pipeline.append(launched)
        if not pipeline:
            return []
        self.max_steps_in_flight = max(self.max_steps_in_flight, len(pipeline))
        return self.finish_step(pipeline.popleft())

    def drain(self) -> list[EngineCoreOutput]:
        """Wait for the steps still in flight (async scheduling, pipelined steps) and return their
        outputs."""
        self._sample_awaiting()        # only after an error: finish_step samples it otherwise
        done, self._in_flight = self._in_flight, None
        outputs = self.finish_step(done) if done is not None else []
        while self._pipeline:
            outputs += self.finish_step(self._pipeline.popleft())
        self._flush_kv_saves()
        return outputs

    def _flush_kv_saves(self) -> None:
        """Hand out the saves the last step's finished requests left (write-through), so an idle
        engine does not sit on them until its next step."""
        tiers = self.scheduler.tiers
        if tiers is not None and not self.scheduler.has_unfinished_requests_besides_tiers():
            saves, loads = tiers.take_step_ops()
            if saves or loads:
                self.executor.submit_kv_transfers(SchedulerOutput(kv_saves=saves, kv_loads=loads))

    def _launch_if_any(self, ahead: bool = False) -> tuple[SchedulerOutput, object] | None:
        launched = self.launch_step(ahead)
        return None if launched[1] is None else launched

    def launch_step(self, ahead: bool = False) -> tuple[SchedulerOutput, object]:
        """Schedule and queue one step on the device. The caller may do host work (such as
        detokenizing the previous step's outputs) before `finish_step`, overlapping the GPU.
        `ahead`: a step is still in flight (async scheduling); grammar rows that wait for its
        tokens defer this step's sampling to the `finish_step` of that step."""
        tiers = self.scheduler.tiers
        if tiers is not None and tiers.loading:
            self.scheduler.finish_tier_loads(self.executor.poll_kv_loads())
        scheduler_output = self.scheduler.schedule()
        if tiers is not None:
            self.executor.submit_kv_transfers(scheduler_output)
            if scheduler_output.is_empty and tiers.loading:
                self.executor.wait_kv_loads(0.005)    # nothing to run but loads: do not spin
        if scheduler_output.is_empty and not scheduler_output.finished_request_ids:
            return scheduler_output, None
        if ahead and self.grammars.waits_for_tokens(scheduler_output):
            handle = self.executor.launch(scheduler_output, defer_sampling=True)
            self._awaiting_masks = (scheduler_output, handle)
            return scheduler_output, handle
        # Every matcher this step reads has consumed all its request's known tokens.
        self.grammars.fill(scheduler_output, self.executor.grammar_bitmask_buffer)
        return scheduler_output, self.executor.launch(scheduler_output)

    def finish_step(self, launched: tuple[SchedulerOutput, object]) -> list[EngineCoreOutput]:
        scheduler_output, handle = launched
        if handle is None:
            return []
        runner_output = self.executor.collect(handle)
        if len(self.grammars):
            self.grammars.advance(scheduler_output, runner_output)
        # The step launched ahead runs its forward on the device meanwhile (the forward never
        # waits for grammar work); its masks need the tokens just collected, and nothing else.
        self._sample_awaiting()
        if scheduler_output.is_empty:
            return []
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if len(self.grammars):
            self.grammars.forget_finished(outputs)
        return outputs

    def _sample_awaiting(self) -> None:
        if self._awaiting_masks is None:
            return
        (sched, handle), self._awaiting_masks = self._awaiting_masks, None
        self.grammars.fill(sched, self.executor.grammar_bitmask_buffer)
        self.executor.sample(handle, sched)

    def has_unfinished_requests(self) -> bool:
        return (self._in_flight is not None or self.scheduler.has_unfinished_requests()
                or bool(self._pipeline))

    def get_stats(self) -> EngineStats:
        stats = self.scheduler.get_stats()
        stats.allocator_fragmentation = self.executor.allocator_fragmentation()
        stats.kv_tiers = self.executor.kv_tier_stats()
        return stats

    def set_kv_tiers_enabled(self, enabled: bool) -> None:
        """Turn the tiers' lookups and saves on or off (benchmarks compare the device cache alone)."""
        if self.scheduler.tiers is None:
            raise ValueError("no KV tier is configured")
        self.scheduler.tiers.enabled = enabled

    def start_profile(self) -> None:
        self.executor.start_profile()

    def stop_profile(self) -> str:
        return self.executor.stop_profile()

    def shutdown(self) -> None:
        """Stop the workers and free the device memory now (steps still in flight hold logits
        and sampled ids on the device: they go first)."""
        self._in_flight = self._awaiting_masks = None
        self._pipeline.clear()
        self.executor.shutdown()
