"""The dashboard's numbers: a ring of samples of the engine's state and the server's own metrics.

In: every `interval` seconds an EngineStats snapshot (applied to ServerMetrics as /metrics does)
and the server's Prometheus counters and histograms. Out: `body(since)`, the JSON of
GET /ui/api/stats: the latest totals, and per sample the gauges, tokens/s in and out, the
prefix-cache hit rate and TTFT/TPOT percentiles over the last `window` seconds. Percentiles are
estimated from the histograms' bucket counts as Prometheus' histogram_quantile does (linear
inside a bucket), so they are the numbers a Grafana panel on /metrics would show.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass

import msgspec

from tokenforge.messages import EngineStats
from tokenforge.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

QUANTILES = (0.5, 0.9, 0.99)


@dataclass(slots=True)
class _Raw:
    """Cumulative values at one instant (what the derived series are differences of)."""

    t: float
    prompt: float
    generation: float
    prefix_queries: int
    prefix_hits: int
    ttft: list[float]          # cumulative bucket counts, the last is +Inf
    tpot: list[float]


def samples_of(metric, suffix: str, model: str) -> list:
    return [s for family in metric.collect() for s in family.samples
            if s.name.endswith(suffix) and s.labels.get("model_name") == model]


def counter_total(metric, model: str) -> float:
    return sum(s.value for s in samples_of(metric, "_total", model))


def bucket_counts(histogram, model: str) -> tuple[list[float], list[float]]:
    """(upper bounds without +Inf, cumulative counts with +Inf last)."""
    buckets = samples_of(histogram, "_bucket", model)
    bounds = [float(s.labels["le"]) for s in buckets if s.labels["le"] != "+Inf"]
    return bounds, [s.value for s in buckets]


def quantile(q: float, bounds: list[float], counts: list[float]) -> float | None:
    """histogram_quantile over cumulative counts (len(bounds) + 1 of them); None when empty."""
    total = counts[-1] if counts else 0
    if total <= 0:
        return None
    rank = q * total
    for i, count in enumerate(counts):
        if count >= rank:
            if i == len(bounds):          # the +Inf bucket: its lower bound is all that is known
                return bounds[-1] if bounds else None
            lower, below = (bounds[i - 1], counts[i - 1]) if i else (0.0, 0.0)
            if count == below:
                return bounds[i]
            return lower + (bounds[i] - lower) * (rank - below) / (count - below)
    return bounds[-1] if bounds else None


def _rate(new: float, old: float, dt: float) -> float:
    return max(0.0, new - old) / dt if dt > 0 else 0.0


class StatsHistory:
    def __init__(self, metrics: ServerMetrics, interval: float = 1.0, keep_s: float = 600.0,
                 window: float = 60.0) -> None:
        self.metrics = metrics
        self.interval = interval
        self.window = window
        self.raw: deque[_Raw] = deque(maxlen=int(keep_s / interval) + 1)
        self.samples: deque[dict] = deque(maxlen=self.raw.maxlen)
        self.stats = EngineStats()
        self.bounds: dict[str, list[float]] = {}
        self._task: asyncio.Task | None = None

    def start(self, engine) -> None:
        """Sample `engine` every interval from now on (idempotent; needs a running loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(engine), name="ui-stats-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self, engine) -> None:
        while True:
            try:
                self.record(await engine.get_stats(timeout=1.0))
            except Exception:  # noqa: BLE001 - a failed sample is a gap in the charts, never a dead sampler
                logger.debug("dashboard sample failed", exc_info=True)
            await asyncio.sleep(self.interval)

    def record(self, stats: EngineStats, now: float | None = None) -> dict:
        """Take one sample: apply `stats` to the metrics, then derive this sample's row."""
        m, name = self.metrics, self.metrics.model_name
        m.update_engine(stats)
        self.stats = stats
        self.bounds["ttft"], ttft = bucket_counts(m.ttft, name)
        self.bounds["tpot"], tpot = bucket_counts(m.itl, name)
        raw = _Raw(time.time() if now is None else now, counter_total(m.prompt_tokens, name),
                   counter_total(m.generation_tokens, name), stats.prefix_cache_queries, stats.prefix_cache_hits,
                   ttft, tpot)
        row = self._row(raw)
        self.raw.append(raw)
        self.samples.append(row)
        return row

    def _row(self, raw: _Raw) -> dict:
        s = self.stats
        row = {"t": round(raw.t, 3), "running": s.num_running, "waiting": s.num_waiting,
               "kv_usage": round(s.kv_usage, 4), "prompt_tps": 0.0, "gen_tps": 0.0, "prefix_hit_rate": None}
        if self.raw:
            last = self.raw[-1]
            dt = raw.t - last.t
            row["prompt_tps"] = round(_rate(raw.prompt, last.prompt, dt), 2)
            row["gen_tps"] = round(_rate(raw.generation, last.generation, dt), 2)
        base = self._window_start(raw.t)
        if base is not None:
            queries = raw.prefix_queries - base.prefix_queries
            if queries > 0:
                row["prefix_hit_rate"] = round((raw.prefix_hits - base.prefix_hits) / queries, 4)
        for key in ("ttft", "tpot"):
            now = getattr(raw, key)
            old = getattr(base, key) if base is not None else [0.0] * len(now)
            delta = [a - b for a, b in zip(now, old)]
            for q in QUANTILES:
                value = quantile(q, self.bounds[key], delta)
                row[f"{key}_p{int(q * 100)}"] = None if value is None else round(value, 5)
        return row

    def _window_start(self, now: float) -> _Raw | None:
        """The newest sample at least `window` s old (the oldest while the history is shorter)."""
        base = self.raw[0] if self.raw else None
        for r in self.raw:
            if r.t > now - self.window:
                break
            base = r
        return base

    def totals(self) -> dict:
        s, m, name = self.stats, self.metrics, self.metrics.model_name
        finished = {sample.labels["finished_reason"]: sample.value
                    for sample in samples_of(m.request_success, "_total", name)}
        return {"running": s.num_running, "waiting": s.num_waiting, "kv_usage": s.kv_usage,
                "kv_fragmentation": s.kv_fragmentation, "num_kv_blocks": s.num_kv_blocks,
                "num_free_blocks": s.num_free_blocks, "prefix_cache_queries": s.prefix_cache_queries,
                "prefix_cache_hits": s.prefix_cache_hits, "preemptions": s.num_preemptions,
                "prompt_tokens": counter_total(m.prompt_tokens, name),
                "generation_tokens": counter_total(m.generation_tokens, name), "finished": finished,
                "kv_tiers": None if s.kv_tiers is None else msgspec.to_builtins(s.kv_tiers)}

    def body(self, since: float = 0.0) -> dict:
        return {"interval": self.interval, "window": self.window, "totals": self.totals(),
                "samples": [row for row in self.samples if row["t"] > since]}
