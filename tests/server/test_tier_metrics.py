"""The KV tiers' counters on /metrics: per tier, by cause, and the restore histogram (cumulative)."""

from __future__ import annotations

from tokenforge.messages import EngineStats, KVTierStats
from tokenforge.server.metrics import ServerMetrics


def test_tier_metrics_render_from_the_engine_snapshot():
    metrics = ServerMetrics("m")
    assert b"kv_tier" not in metrics.render()           # no tiers configured: nothing exported
    stats = KVTierStats(hits={"cpu": 3, "remote": 2}, misses={"disk": 1}, bytes_restored={"cpu": 300},
                        puts={"remote": 7}, dropped_puts={"backpressure": 4},
                        errors={"checksum": 1, "remote_timeout": 2},
                        restore_bounds=[0.01, 0.1], restore_counts=[1, 2, 1], restore_sum=0.5, restored_tokens=80,
                        remote_up=False)
    metrics.update_engine(EngineStats(kv_tiers=stats))
    text = metrics.render().decode()
    for line in ('tokenforge:kv_tier_hits_total{model_name="m",tier="cpu"} 3.0',
                 'tokenforge:kv_tier_hits_total{model_name="m",tier="disk"} 0.0',
                 'tokenforge:kv_tier_misses_total{model_name="m",tier="disk"} 1.0',
                 'tokenforge:kv_tier_bytes_restored_total{model_name="m",tier="cpu"} 300.0',
                 'tokenforge:kv_tier_puts_total{model_name="m",tier="remote"} 7.0',
                 'tokenforge:kv_tier_dropped_puts_total{model_name="m",reason="backpressure"} 4.0',
                 'tokenforge:kv_tier_errors_total{cause="remote_timeout",model_name="m"} 2.0',
                 'tokenforge:kv_tier_restored_tokens_total{model_name="m"} 80.0',
                 'tokenforge:kv_tier_remote_up{model_name="m"} 0.0',
                 'tokenforge:kv_tier_restore_seconds_bucket{le="0.1",model_name="m"} 3.0',
                 'tokenforge:kv_tier_restore_seconds_bucket{le="+Inf",model_name="m"} 4.0',
                 'tokenforge:kv_tier_restore_seconds_count{model_name="m"} 4.0'):
        assert line in text, line
