"""Prometheus metrics, named like vLLM's with the prefix `tokenforge:`.

Engine gauges and cumulative counters come from EngineStats snapshots (the core's view); the
per-request histograms and token counters are observed here, where requests start and finish.
Each server owns its own registry, so several apps in one process (tests) do not collide.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from tokenforge.messages import EngineStats, RequestOutput
from tokenforge.server.tier_metrics import KVTierCollector

CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()   # the *_created samples only add noise to every scrape

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tokenforge:{name}", doc, labels, registry=self.registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"tokenforge:{name}", doc, labels + list(extra), registry=self.registry)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"tokenforge:{name}", doc, labels, buckets=buckets, registry=self.registry)

        self.running = gauge("num_requests_running", "Sequences running in the engine.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting in the engine.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).")
        self.kv_fragmentation = gauge("kv_cache_fragmentation", "Unused slots in partly filled blocks / allocated slots.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (recomputed later).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter("request_success", "Finished completions, by finish reason.", ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Time to the first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between successive output chunks.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to the first scheduled step.", _LATENCY_BUCKETS)
        self.drain_aborted = counter("num_requests_drain_aborted",
                                     "Requests cut (finish_reason abort) when the SIGTERM drain window ran out.")
        self._last_cumulative = (0, 0, 0)
        self.spec = SpecDecodeCounters(counter)
        self.late_compiles = gauge("jit_compiles_after_ready", "Kernels compiled after start-up (each one a request "
                                   "waited for; the core logs what it was). 0 is the goal.")
        self.graphs_pending = gauge("cuda_graphs_pending", "Decode batch buckets whose CUDA graph is still to be "
                                    "captured (the engine captures them while idle after start-up)")
        self.eager_decodes = gauge("eager_decode_steps", "Decode steps run without a CUDA graph because their "
                                   "bucket was not captured yet (since start-up)")
        self.kv_tiers = KVTierCollector(model_name)
        self.registry.register(self.kv_tiers)
        for metric in (self.prefix_queries, self.prefix_hits, self.preemptions, self.prompt_tokens,
                       self.generation_tokens, self.drain_aborted):
            metric.labels(model_name)   # exported as 0 before the first request
        self.children = _Children(self)

    def set_model_info(self, version: str | None, checksum: str) -> None:
        """`tokenforge:model_info{model_name, version, checksum} 1`: what a router compares."""
        info = Gauge("tokenforge:model_info", "The served weights: pinned version and sha256 checksum.",
                     ["model_name", "version", "checksum"], registry=self.registry)
        info.labels(self.model_name, version or "", checksum).set(1)

    def update_engine(self, stats: EngineStats) -> None:
        m = self.model_name
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_usage)
        self.kv_fragmentation.labels(m).set(stats.kv_fragmentation)
        if stats.kv_tiers is not None:
            self.kv_tiers.stats = stats.kv_tiers
        if stats.spec_decode is not None:
            self.spec.update(m, stats.spec_decode)
        self.late_compiles.labels(m).set(stats.jit_compiles_after_ready)
        self.graphs_pending.labels(m).set(stats.cuda_graphs_pending)
        self.eager_decodes.labels(m).set(stats.eager_decode_steps)
        # The core reports running totals; Prometheus counters only increase, so add the growth.
        now = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions)
        for counter, new, old in zip((self.prefix_queries, self.prefix_hits, self.preemptions), now,
                                     self._last_cumulative):
            if new > old:
                counter.labels(m).inc(new - old)
        self._last_cumulative = tuple(max(n, o) for n, o in zip(now, self._last_cumulative))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class SpecDecodeCounters:
    """Speculative decoding, under vLLM's names (tokenforge: prefix): drafts verified, draft
    tokens proposed and accepted, and accepted drafts per position. Acceptance rate =
    accepted / draft tokens; mean acceptance length = 1 + accepted / drafts."""

    def __init__(self, counter) -> None:
        self.drafts = counter("spec_decode_num_drafts", "Sequences verified with at least one draft token.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position "
                               "in the draft (0 = the first).", ("position",))
        self._last: tuple[int, int, int, list[int]] = (0, 0, 0, [])

    def update(self, model: str, s) -> None:
        last_drafts, last_tokens, last_accepted, last_pos = self._last
        for counter, new, old in ((self.drafts, s.num_drafts, last_drafts),
                                  (self.draft_tokens, s.num_draft_tokens, last_tokens),
                                  (self.accepted, s.num_accepted_tokens, last_accepted)):
            counter.labels(model).inc(max(0, new - old))
        for i, new in enumerate(s.accepted_per_position):
            old = last_pos[i] if i < len(last_pos) else 0
            self.per_pos.labels(model, str(i)).inc(max(0, new - old))
        self._last = (max(s.num_drafts, last_drafts), max(s.num_draft_tokens, last_tokens),
                      max(s.num_accepted_tokens, last_accepted),
                      [max(n, last_pos[i] if i < len(last_pos) else 0) for i, n in enumerate(s.accepted_per_position)])


@dataclass(slots=True)
class AccessRecord:
    """What the access log prints for one HTTP request (filled by its RequestTracker)."""

    start: float = field(default_factory=time.time)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None


# The access-log middleware sets this for the request's task; trackers created inside it fill it.
CURRENT_ACCESS: contextvars.ContextVar[AccessRecord | None] = contextvars.ContextVar("access", default=None)


class _Children:
    """The model's labelled children, looked up once: `labels()` costs more than `observe()`."""

    def __init__(self, metrics: ServerMetrics) -> None:
        m = metrics.model_name
        self.ttft = metrics.ttft.labels(m)
        self.queue_time = metrics.queue_time.labels(m)
        self.prompt_tokens = metrics.prompt_tokens.labels(m)
        self.itl = metrics.itl.labels(m)
        self.generation_tokens = metrics.generation_tokens.labels(m)
        self.e2e = metrics.e2e.labels(m)


class RequestTracker:
    """Observes one request's outputs as they arrive: TTFT, inter-chunk latency, totals."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.children = metrics.children
        self.start = time.time()
        self.last: float | None = None
        self.prompt_tokens = 0
        self.access = CURRENT_ACCESS.get()
        self._prompts_seen: set[int] = set()

    def observe(self, output: RequestOutput) -> None:
        now = time.time()
        c = self.children
        new_tokens = sum(len(o.token_ids) for o in output.outputs)
        if self.access is not None:
            self._record(output, new_tokens, now)
        if new_tokens:
            if self.last is None:
                arrival = output.metrics.get("arrival_time") or self.start
                c.ttft.observe(max(0.0, now - arrival))
                c.queue_time.observe(output.metrics.get("queue_time", 0.0))
                self.prompt_tokens = len(output.prompt_token_ids)
                c.prompt_tokens.inc(self.prompt_tokens)
            else:
                c.itl.observe(now - self.last)
            self.last = now
            c.generation_tokens.inc(new_tokens)
        for completion in output.outputs:
            if completion.finish_reason is not None:
                self.metrics.request_success.labels(self.metrics.model_name, str(completion.finish_reason)).inc()
        if output.finished:
            arrival = output.metrics.get("arrival_time") or self.start
            c.e2e.observe(max(0.0, now - arrival))

    def _record(self, output: RequestOutput, new_tokens: int, now: float) -> None:
        access = self.access
        if output.request_id not in self._prompts_seen:
            self._prompts_seen.add(output.request_id)
            access.prompt_tokens += len(output.prompt_token_ids)
        access.completion_tokens += new_tokens
        if new_tokens and access.ttft is None:
            access.ttft = now - access.start
