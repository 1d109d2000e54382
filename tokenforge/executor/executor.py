"""Executor: the engine's one handle on the workers that run the model.

In: an EngineConfig. Out: `execute(SchedulerOutput) -> ModelRunnerOutput`, plus the facts the
engine needs once (the KV block count, the vocabulary, the model's context limit). Today one
in-process worker; tensor/pipeline-parallel executors implement the same three methods.
"""

from __future__ import annotations

import logging
import os
import time

from tokenforge import envs
from tokenforge.config import EngineConfig
from tokenforge.core.outputs import ModelRunnerOutput, SchedulerOutput, TierLoadResult
from tokenforge.executor.engine_cache import use_engine_cache
from tokenforge.messages import KVTierStats

logger = logging.getLogger(__name__)


class Executor:
    def __init__(self, config: EngineConfig) -> None:
        envs.set_default("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        use_engine_cache(config)
        from tokenforge.executor.model_runner import ModelRunner  # noqa: PLC0415 - after the env var

        start = time.perf_counter()
        self.runner = ModelRunner(config)
        self.load_seconds = time.perf_counter() - start
        logger.info("model loaded in %.2f s (%s, %s)", self.load_seconds, self.runner.device, self.runner.dtype)
        self._init_state()

    def _init_state(self) -> None:
        """The state every executor starts with, whatever builds its model (MultiprocExecutor builds
        none here and does not run Executor.__init__)."""
        self.tiers = None                                     # KV tiers: build_tiers, one process only
        self._verify_costs: dict[int, float | None] = {}     # K -> the timed ratio (verify_cost_ratio)

    @property
    def arch(self):
        return self.runner.arch

    @property
    def is_async_device(self) -> bool:
        """Whether `launch` returns before the device finishes (so host work can overlap it)."""
        return self.runner.device.type == "cuda"

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def init_kv_cache(self, config: EngineConfig, defer_graphs: bool = False) -> int:
        """`defer_graphs`: CUDA graphs of the small decode buckets now, the rest through
        `capture_deferred_graph` once the engine is Ready and idle (executor/graph_stages.py)."""
        from tokenforge.executor.kv_cache import determine_kv_sizing  # noqa: PLC0415

        start = time.perf_counter()
        sizing = determine_kv_sizing(self.runner, config, config.scheduler.max_model_len)
        self.sizing = sizing
        # allocates (and on CUDA captures graphs)
        self.runner.init_kv_cache(sizing.num_blocks, config.scheduler.max_model_len, defer_graphs=defer_graphs)
        logger.info("KV cache ready in %.2f s: %s", time.perf_counter() - start,
                    sizing.summary(config.cache.block_size, config.scheduler.max_model_len))
        return sizing.num_blocks

    def capture_deferred_graph(self) -> bool:
        """Capture one deferred CUDA graph (only while no step is in flight); whether more remain."""
        graphs = self.runner.graphs
        return graphs is not None and graphs.capture_next()

    def verify_cost_ratio(self, num_draft_tokens: int) -> float | None:
        """A speculative step of one sequence (its draft graph, if the drafter has one, and the verify
        of 1 + K rows) over a one-row decode, timed on the CUDA graphs at start-up: the adaptive
        rule's calibration (core/speculation.py). None without graphs or speculation, and under
        tensor parallelism, whose graphs hold collectives the other ranks would have to join. A
        drafter that is not timed (a draft model) counts for nothing: the verify alone. Timed once
        per K; later calls return the same figure (what the rule was given)."""
        if num_draft_tokens not in self._verify_costs:
            self._verify_costs[num_draft_tokens] = self._time_verify_cost(num_draft_tokens)
        return self._verify_costs[num_draft_tokens]

    def _time_verify_cost(self, num_draft_tokens: int) -> float | None:
        graphs = self.runner.graphs
        if not num_draft_tokens or not hasattr(graphs, "replay_seconds") or self.runner.rank.tp_size > 1:
            return None
        try:
            one, verify = graphs.replay_seconds(1), graphs.replay_seconds(1 + num_draft_tokens)
            timed = getattr(self.runner.drafter, "draft_seconds", None)
            draft = timed(num_draft_tokens) if timed is not None else None
        except RuntimeError as exc:     # a calibration, not a requirement: the rule keeps its model cost
            logger.warning("could not time the verify graph (%s); the adaptive rule uses its model cost", exc)
            return None
        if not one or verify is None:
            return None
        logger.info("speculative step at K = %d, timed on the graphs: decode %.1f us, verify of %d rows %.1f us, "
                    "drafts %.1f us", num_draft_tokens, one * 1e6, 1 + num_draft_tokens, verify * 1e6, (draft or 0.0) * 1e6)
        return (verify + (draft or 0.0)) / one

    def graph_counts(self) -> tuple[int, int]:
        """(deferred CUDA-graph buckets not captured yet, decode steps run eagerly for want of one)."""
        graphs = self.runner.graphs
        return graphs.counts() if graphs is not None else (0, 0)

    def init_kv_tiers(self, config: EngineConfig) -> None:
        """The CPU/disk/Redis tiers over the allocated KV cache (only when some tier is set)."""
        from tokenforge.executor.tiers import build_tier_manager  # noqa: PLC0415

        self.tiers = build_tier_manager(config, self.runner.kv_caches, self.arch)

    def submit_kv_transfers(self, scheduler_output: SchedulerOutput) -> None:
        """Queue the step's tier saves and loads; before `launch`, so saves precede the forward."""
        if scheduler_output.kv_saves or scheduler_output.kv_loads:
            self.tiers.submit(scheduler_output.kv_saves, scheduler_output.kv_loads)

    def poll_kv_loads(self) -> list[TierLoadResult]:
        return self.tiers.poll()

    def wait_kv_loads(self, timeout: float) -> None:
        self.tiers.wait(timeout)

    def kv_tier_stats(self) -> KVTierStats | None:
        return self.tiers.counters.snapshot() if self.tiers is not None else None

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.collect(self.runner.launch(scheduler_output))

    def launch(self, scheduler_output: SchedulerOutput, defer_sampling: bool = False):
        """Queue a step on the device; `collect` waits for it. Host work in between overlaps it.
        With `defer_sampling` only the forward is queued; `sample` queues the rest."""
        return self.runner.launch(scheduler_output, defer_sampling)

    def sample(self, handle, scheduler_output: SchedulerOutput) -> None:
        """Queue the sampling of a step launched with `defer_sampling`, reading the grammar rows
        and bitmask set on `scheduler_output` since; before the next `launch`."""
        self.runner.sample(handle, scheduler_output)

    def grammar_bitmask_buffer(self, rows: int, width: int):
        """A reused host array [rows, width] int32 to write a step's grammar bitmask into."""
        return self.runner.grammar_bitmask_buffer(rows, width)

    def collect(self, handle) -> ModelRunnerOutput:
        return self.runner.collect(handle)

    def allocator_fragmentation(self) -> float:
        return self.runner.allocator_fragmentation()

    def add_lora(self, lora) -> str:
        """Read and check a LoRA adapter into host memory (ValueError naming it); its fingerprint."""
        if self.runner.loras is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: the engine serves no LoRA adapters "
                             "(start it with --enable-lora)")
        return self.runner.loras.add(lora)

    def remove_lora(self, name: str) -> int:
        return self.runner.loras.remove(name) if self.runner.loras is not None else 0

    def start_profile(self) -> None:
        """torch.profiler over the following steps; traces go to `--profile-dir`."""
        import torch  # noqa: PLC0415

        profile_dir = self.runner.config.device.profile_dir
        if not profile_dir:
            raise ValueError("profiling needs a profile directory (--profile-dir / profile_dir=...)")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities, on_trace_ready=torch.profiler.tensorboard_trace_handler(profile_dir))
        self.profile_summary: dict | None = None
        self._profiler.start()

    def stop_profile(self) -> str:
        """Stop profiling, write the trace, and return the top of the kernel-time table."""
        profiler, self._profiler = getattr(self, "_profiler", None), None
        if profiler is None:
            return ""
        profiler.stop()
        sort = "self_cuda_time_total" if self.runner.device.type == "cuda" else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort, row_limit=25)
        self.profile_summary = device_busy(profiler.events())
        if self.profile_summary:
            s = self.profile_summary
            table = (f"device busy {s['busy_ms']:.1f} ms of {s['span_ms']:.1f} ms between the first and the "
                     f"last kernel ({100 * s['busy_frac']:.1f}%), {s['num_kernels']} device events\n\n{table}")
        with open(os.path.join(self.runner.config.device.profile_dir, "summary.txt"), "w", encoding="utf-8") as f:
            f.write(table)
        return table

    def shutdown(self) -> None:
        if self.tiers is not None:
            self.tiers.shutdown()
            self.tiers = None
        if self.runner is not None:
            from tokenforge.executor.release import release_runner  # noqa: PLC0415

            release_runner(self.runner)
        self.runner = None


def device_busy(events) -> dict | None:
    """How much of the profiled span the GPU was executing something (kernels, copies, graph
    nodes): the union of the device events' intervals over the first-start..last-end span. Near
    100% means the host keeps the device fed; host-bound loops show up as gaps."""
    from torch.autograd import DeviceType  # noqa: PLC0415

    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    if not spans:
        return None
    busy, cur_start, cur_end = 0.0, spans[0][0], spans[0][1]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = max(end for _, end in spans) - spans[0][0]
    return {"busy_ms": busy / 1e3, "span_ms": span / 1e3, "busy_frac": busy / span if span else 0.0,
            "num_kernels": len(spans)}
