"""EngineCore: schedule -> execute -> update; `step()` fills the in-flight queue, finishes the oldest.

In: EngineCoreRequests and aborts. Out: EngineCoreOutputs (token ids, logprobs, finish reasons)
and EngineStats. It owns the scheduler (policy, no torch) and the executor (the model). It runs
in-process for the offline `LLM`, and in its own process behind the server.
"""

from __future__ import annotations

import importlib
import logging
import time

import msgspec

from tokenforge import envs
from tokenforge.config import EngineConfig
from tokenforge.core.outputs import SchedulerOutput
from tokenforge.core.scheduler import Scheduler
from tokenforge.config.draft_tree import DraftTree, tree_drafts_apply
from tokenforge.core.speculation import (ChainShape, DraftCheck, DraftPlanner, StepCost, TreeShape, allow_all,
                                         device_drafts)
from tokenforge.engine.core_boot import process_start_time
from tokenforge.engine.inflight import InFlightQueue, LaunchedStep
from tokenforge.engine.startup import resolve_engine_config
from tokenforge.engine.structured_output import GrammarMatchers
from tokenforge.engine.tokenization import config_tokenizer, load_engine_tokenizer, with_calibration_ids
from tokenforge.executor.compile_watch import WATCH
from tokenforge.executor.factory import create_executor
from tokenforge.executor.spec.burst import configured_burst_steps
from tokenforge.messages import EngineCoreOutput, EngineCoreRequest, EngineStats, LoRARequest

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
    warm = getattr(runner, "warmup_seconds", 0.0) or 0.0
    phases = {"before_engine": _seconds_since_process_start() - executor_s - kv_s,
              "load": executor_s, "kv_cache": kv_s - graphs - warm, "cuda_graphs": graphs}
    if warm:
        phases["warm_up"] = warm
    phases["total"] = sum(phases.values())
    return phases


def _seconds_since_process_start() -> float:
    return max(0.0, time.time() - process_start_time())


def draft_shape(config: EngineConfig) -> ChainShape | TreeShape:
    """Chains, or --speculative-tree's static tree where the attention backend masks trees (the
    runner makes the same choice: executor/spec/components.py)."""
    if tree_drafts_apply(config):
        return TreeShape(DraftTree.build(config.scheduler.num_draft_tokens))
    if config.scheduler.speculative_tree:
        logger.warning("speculative_tree: the triton attention backend has no tree kernel yet, so the EAGLE head "
                       "drafts chains (trees run on --attention-backend torch)")
    return ChainShape()


def make_draft_planner(config, on_gpu: bool = False, check: DraftCheck = allow_all,
                       shape: ChainShape | TreeShape | None = None, burst: int = 0,
                       verify_ratio: float | None = None) -> DraftPlanner | None:
    """The speculative method's proposer, chosen once (None without speculative decoding). The
    adaptive rule's step cost: on a GPU a forward costs about the same up to ~a hundred rows (the
    weights' read dominates) and a synchronous step loses the overlap of async scheduling;
    `verify_ratio`, a verify of 1 + K rows over a one-row decode as the runner timed it, calibrates
    what leaving the one-row path costs. `check`: the grammar matchers' cut of a constrained
    request's drafts. `burst`: the verify iterations of the runner's n-gram bursts
    (config.draft_tree.burst_steps; 0: none)."""
    if config.speculative_method is None:
        return None
    cost = StepCost(flat_rows=128.0, sync_cost=1.1) if on_gpu else StepCost(flat_rows=16.0, sync_cost=1.0)
    cost = cost.calibrated(verify_ratio, 1 + config.num_draft_tokens)
    if verify_ratio is not None:
        logger.info("speculative decoding: a verify of %d rows costs %.2fx a one-row decode on this device",
                    1 + config.num_draft_tokens, verify_ratio)
    if config.speculative_method in ("draft", "eagle"):     # the runner's draft model / head fills the slots
        return DraftPlanner(device_drafts, config.num_draft_tokens, cost, check=check, shape=shape,
                            clock=time.perf_counter)
    factory = envs.draft_proposer()
    if factory:     # a measuring device's host proposer in the n-gram method's place (bench serve's replay)
        module, _, name = factory.partition(":")
        return DraftPlanner(getattr(importlib.import_module(module), name)(), config.num_draft_tokens, cost,
                            check=check, clock=time.perf_counter)
    from tokenforge.executor.spec.ngram import NgramProposer  # noqa: PLC0415

    proposer = NgramProposer(config.ngram_min, config.ngram_max)
    slots = burst * (config.num_draft_tokens + 1) - 1 if burst else 0
    return DraftPlanner(proposer.propose_one, config.num_draft_tokens, cost, check=check, burst_slots=slots,
                        clock=time.perf_counter)


def check_draft_tokenizer(config, tokenizer=None) -> None:
    """A draft model whose tokenizer maps text to other ids than the target's is refused before any
    model loads (one that ships no tokenizer is checked by its vocabulary size only, by the executor)."""
    sched = config.scheduler
    if sched.speculative_method != "draft":
        return
    try:
        draft = load_engine_tokenizer(sched.speculative_model)
    except (OSError, ValueError):
        return
    target = tokenizer or config_tokenizer(config)
    vocab = [getattr(getattr(t, "hf", None), "get_vocab", None) for t in (target, draft)]
    if all(vocab) and vocab[0]() != vocab[1]():
        raise ValueError(f"speculative_model {sched.speculative_model!r} has another tokenizer than the target: "
                         "a draft model must use the target's tokenizer (the same token ids)")


def check_tokenizer_fits(config, arch, tokenizer=None) -> None:
    """--tokenizer: its ids must index the model's embedding, `arch.vocab_size` (ValueError naming
    both sizes). Nothing is read without the flag."""
    path = config.model.tokenizer
    if path is None:
        return
    vocab_size = arch.vocab_size
    size = (tokenizer or config_tokenizer(config)).vocab_size
    if size > vocab_size:
        raise ValueError(f"tokenizer {path!r} has {size} tokens, more than the model's vocabulary of {vocab_size}: "
                         "its ids would index past the embedding (use the model's own tokenizer or one of its size)")


class EngineCore:
    def __init__(self, config: EngineConfig, tokenizer=None, defer_graphs: bool = True) -> None:
        """`defer_graphs`: capture the large CUDA-graph buckets after start-up, from `idle_work`
        (the core process's idle loop); the offline LLM, which has no idle loop, captures all now."""
        t0, wall0 = time.perf_counter(), time.time()
        WATCH.reset()
        WATCH.install_triton_hook()     # compiles from here on are start-up's; after Ready, warnings
        config = resolve_engine_config(config)     # the device, its batch limits, the fit (StartupRefused)
        config = with_calibration_ids(config, tokenizer)      # a bad calibration text fails before loading
        check_draft_tokenizer(config, tokenizer)
        self.executor = create_executor(config)
        try:
            t1, wall1 = time.perf_counter(), time.time()
            arch = self.executor.arch
            check_tokenizer_fits(config, arch, tokenizer)
            self.config = config.with_max_model_len(
                resolve_max_model_len(config.model.max_model_len, arch.max_position_embeddings))
            self.num_kv_blocks = self.executor.init_kv_cache(self.config, defer_graphs=defer_graphs)
            self.startup_phases = startup_phases(t1 - t0, time.perf_counter() - t1, self.executor)
            self.startup_marks = {"engine_start": wall0, "loaded": wall1, "kv_ready": time.time()}   # the timeline's
            logger.info("start-up: %s", ", ".join(f"{k} {v:.2f} s" for k, v in self.startup_phases.items()))
            resolved = self.config
            self.grammars = GrammarMatchers(lambda: tokenizer or config_tokenizer(resolved), self.vocab_size)
            lora = self.config.lora
            drafts = make_draft_planner(self.config.scheduler, self.executor.is_async_device,
                                        self.grammars.allowed_drafts, draft_shape(self.config),
                                        configured_burst_steps(self.config, arch),
                                        self.executor.verify_cost_ratio(self.config.scheduler.num_draft_tokens))
            self.scheduler = Scheduler(self.config.scheduler, self.config.cache, self.num_kv_blocks, drafts,
                                       lora.max_loras if lora.enable_lora else 0)
            self.lora_keys: dict[tuple[str, int, str], str] = {}   # (name, id, path) -> fingerprint, once read
            if self.scheduler.tiers is not None:
                self.executor.init_kv_tiers(self.config)
            # With speculative decoding, steps that draft run synchronously (their drafts read the
            # step before's tokens) and the others may still be scheduled ahead (DraftPlanner).
            mode = self.config.scheduler.async_scheduling
            # Auto: on where launches are asynchronous (CUDA); on the CPU a launch runs the model.
            self.async_scheduling = mode if mode is not None else self.executor.is_async_device
        except BaseException:
            # a start that fails past this point (a check, the KV cache, the calibration) takes its
            # workers, process group and device memory down with it: the next engine in this
            # process starts clean (a TP engine left behind made the next one wait on its group)
            self.executor.shutdown()
            raise
        WATCH.mark_ready()

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.executor.vocab_size

    def add_lora(self, lora: LoRARequest) -> str:
        """Register an adapter (read, checked, kept in host memory); ValueError naming it if it
        cannot be served. Returns its fingerprint, the key of its slots and prefix-cache blocks."""
        ident = (lora.lora_name, lora.lora_int_id, lora.lora_path)
        if lora.lora_int_id < 1:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: lora_int_id must be a positive integer, "
                             f"got {lora.lora_int_id}")
        self.lora_keys[ident] = self.executor.add_lora(lora)
        return self.lora_keys[ident]

    def lora_key(self, lora: LoRARequest) -> str:
        """The fingerprint of an adapter, read and registered only the first time its (name, id,
        path) is seen: a request naming a known adapter costs no file read (as vLLM's int ids)."""
        return self.lora_keys.get((lora.lora_name, lora.lora_int_id, lora.lora_path)) or self.add_lora(lora)

    def remove_lora(self, name: str) -> bool:
        """Forget an adapter: its host copy goes now; requests already admitted finish with it."""
        idents = [i for i in self.lora_keys if i[0] == name]
        for ident in idents:
            del self.lora_keys[ident]
        return bool(self.executor.remove_lora(name) or idents)

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.lora is not None:       # the adapter's fingerprint keys its slot and its KV blocks
            request = msgspec.structs.replace(request, lora_key=self.lora_key(request.lora))
        if request.params.grammar is not None:
            self.grammars.add(request.request_id, request.params.grammar, request.params.grammar_after)
        try:
            self.scheduler.add_request(request)
        except ValueError:
            self.grammars.remove([request.request_id])
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.scheduler.abort_requests(request_ids)
            self.grammars.remove(request_ids)

    @property
    def async_scheduling(self) -> bool:
        """Scheduling one step ahead (under pipelined steps the queue keeps K steps instead)."""
        return self._async_scheduling

    @async_scheduling.setter
    def async_scheduling(self, enabled: bool) -> None:
        """The step timing (engine/inflight.py): set at start-up, or between generate() calls."""
        assert not getattr(self, "in_flight", None), "steps are in flight"
        self._async_scheduling = enabled
        self.in_flight = InFlightQueue.for_engine(self.config.scheduler.pipeline_steps, enabled)

    @property
    def pipeline_steps(self) -> int:
        return self.config.scheduler.pipeline_steps

    @property
    def max_steps_in_flight(self) -> int:
        """The most pipelined steps in flight at once (0 without pipelined steps)."""
        return self.in_flight.max_in_flight if self.in_flight.is_pipelined else 0

    def step(self) -> list[EngineCoreOutput]:
        """Fill the in-flight queue, finish the oldest step; returns that step's outputs.

        With async scheduling the next step is scheduled and queued on the device before this
        one's results are read back, so the host work of both (scheduling, input building, output
        processing by the caller) runs while the device computes; under pipeline parallelism up
        to `pipeline_steps` steps over disjoint requests are in flight (engine/inflight.py).
        """
        queue = self.in_flight
        while queue.can_launch(self.scheduler.can_schedule_ahead):
            launched = self._launch(ahead=queue.launches_ahead)
            if launched is None:
                break
            queue.push(launched)
        return self._finish(queue.pop_oldest()) if queue else []

    def drain(self) -> list[EngineCoreOutput]:
        """Finish the steps still in flight and hand out the KV-tier saves they left."""
        outputs: list[EngineCoreOutput] = []
        while self.in_flight:
            outputs += self._finish(self.in_flight.pop_oldest())
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

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's next step, with the KV tiers' loads polled and its transfers queued."""
        tiers = self.scheduler.tiers
        if tiers is None:
            return self.scheduler.schedule()
        if tiers.loading:
            self.scheduler.finish_tier_loads(self.executor.poll_kv_loads())
        scheduler_output = self.scheduler.schedule()
        self.executor.submit_kv_transfers(scheduler_output)
        if scheduler_output.is_empty and tiers.loading:
            self.executor.wait_kv_loads(0.005)    # nothing to run but loads: do not spin
        return scheduler_output

    def _launch(self, ahead: bool) -> LaunchedStep | None:
        """Schedule and queue one step on the device; None when there is nothing to run.
        `ahead`: a step is still in flight; grammar rows that wait for its tokens defer this
        step's sampling until that step is finished."""
        scheduler_output = self._schedule()
        if scheduler_output.is_empty and not scheduler_output.finished_request_ids:
            return None
        if ahead and self.grammars.waits_for_tokens(scheduler_output):
            return LaunchedStep(scheduler_output, self.executor.launch(scheduler_output, defer_sampling=True),
                                awaits_masks=True)
        # Every matcher this step reads has consumed all its request's known tokens.
        self.grammars.fill(scheduler_output, self.executor.grammar_bitmask_buffer)
        return LaunchedStep(scheduler_output, self.executor.launch(scheduler_output))

    def _finish(self, step: LaunchedStep) -> list[EngineCoreOutput]:
        if step.awaits_masks:          # only after an error: it is sampled when the step before finishes
            self._sample(step)
        runner_output = self.executor.collect(step.handle)
        if len(self.grammars):
            self.grammars.advance(step.sched, runner_output)
        # The step launched ahead runs its forward on the device meanwhile (the forward never
        # waits for grammar work); its masks need the tokens just collected, and nothing else.
        waiting = self.in_flight.oldest()
        if waiting is not None and waiting.awaits_masks:
            self._sample(waiting)
        if step.sched.is_empty:
            return []
        outputs = self.scheduler.update_from_output(step.sched, runner_output)
        if len(self.grammars):
            self.grammars.forget_finished(outputs)
        return outputs

    def _sample(self, step: LaunchedStep) -> None:
        step.awaits_masks = False
        self.grammars.fill(step.sched, self.executor.grammar_bitmask_buffer)
        self.executor.sample(step.handle, step.sched)

    def idle_work(self) -> bool:
        """Start-up work left for idle time (one deferred CUDA graph); whether more remains. The
        core process calls it only when no request is queued or running."""
        assert not self.in_flight, "idle work runs with no step in flight"
        return self.executor.capture_deferred_graph()

    def has_unfinished_requests(self) -> bool:
        return bool(self.in_flight) or self.scheduler.has_unfinished_requests()

    def get_stats(self) -> EngineStats:
        stats = self.scheduler.get_stats()
        stats.allocator_fragmentation = self.executor.allocator_fragmentation()
        stats.lora_swaps = self.scheduler.loras.num_swaps
        stats.kv_tiers = self.executor.kv_tier_stats()
        stats.jit_compiles_after_ready = WATCH.compiles_after_ready
        stats.cuda_graphs_pending, stats.eager_decode_steps = self.executor.graph_counts()
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
        self.in_flight.clear()
        self.executor.shutdown()
