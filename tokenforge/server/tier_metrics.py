"""Prometheus export of the KV tiers' counters (`KVTierStats`), from the latest engine snapshot.

The core keeps cumulative totals, so they are exported as they are (counters and one histogram)
by a collector that reads the last snapshot at scrape time. Nothing is exported without tiers.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from tokenforge.messages import KVTierStats

_TIERS = ("cpu", "disk", "remote")
_PER_TIER = (("hits", "KV blocks found in a tier on admission."),
             ("misses", "KV blocks looked up in a tier and not found."),
             ("bytes_restored", "Bytes of KV restored from a tier into the device cache."),
             ("puts", "KV blocks written to a tier."))


class KVTierCollector:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: KVTierStats | None = None

    def describe(self):
        return []      # metrics appear once the engine reports tiers

    def collect(self):
        s = self.stats
        if s is None:
            return
        m = self.model_name
        for field, doc in _PER_TIER:
            family = CounterMetricFamily(f"tokenforge:kv_tier_{field}", doc, labels=["model_name", "tier"])
            values = getattr(s, field)
            for tier in _TIERS:
                family.add_metric([m, tier], values.get(tier, 0))
            yield family
        yield _by_label("kv_tier_dropped_puts", "KV blocks not written, by reason (backpressure, remote_down).",
                        "reason", m, s.dropped_puts)
        yield _by_label("kv_tier_errors", "KV tier faults that fell back to recompute, by cause.",
                        "cause", m, s.errors)
        restored = CounterMetricFamily("tokenforge:kv_tier_restored_tokens",
                                       "Prompt tokens restored from the tiers instead of computed.",
                                       labels=["model_name"])
        restored.add_metric([m], s.restored_tokens)
        yield restored
        copy = CounterMetricFamily("tokenforge:kv_tier_restore_copy_seconds",
                                   "Seconds spent copying restored blocks into the device cache.",
                                   labels=["model_name"])
        copy.add_metric([m], s.restore_copy_sum)
        yield copy
        if s.remote_up is not None:
            up = GaugeMetricFamily("tokenforge:kv_tier_remote_up", "1 while the Redis tier answers.",
                                   labels=["model_name"])
            up.add_metric([m], 1.0 if s.remote_up else 0.0)
            yield up
        yield _restore_histogram(m, s)


def _by_label(name: str, doc: str, label: str, model: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(f"tokenforge:{name}", doc, labels=["model_name", label])
    for key, value in sorted(values.items()):
        family.add_metric([model, key], value)
    return family


def _restore_histogram(model: str, s: KVTierStats) -> HistogramMetricFamily:
    buckets, total = [], 0
    for bound, count in zip([*map(str, s.restore_bounds), "+Inf"], s.restore_counts):
        total += count
        buckets.append((bound, total))
    family = HistogramMetricFamily("tokenforge:kv_tier_restore_seconds", "Time to restore one request's blocks "
                                   "from the tiers into the device cache.", labels=["model_name"])
    family.add_metric([model], buckets, s.restore_sum)
    return family
