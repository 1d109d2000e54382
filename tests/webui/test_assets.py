"""The web UI's assets and its stats, without a browser: what is served, how big the first load
is over the wire, the headers that keep model output from running script, and the dashboard's
numbers (rates and windowed percentiles from the same histograms /metrics exports)."""

from __future__ import annotations

import gzip
import re
from types import SimpleNamespace

import pytest

from tokenforge.messages import EngineStats
from tokenforge.router.metrics import RouterMetrics
from tokenforge.router.replicas import Replica
from tokenforge.router.settings import RouterSettings
from tokenforge.router.ui import RouterUI
from tokenforge.server.metrics import ServerMetrics
from tokenforge.server.ui_stats import StatsHistory, quantile
from tokenforge.webui import ASSET_DIR, Assets

FIRST_LOAD_BUDGET = 200 * 1024     # bytes over the wire (gzip), the target


def first_load(assets: Assets) -> list[str]:
    """The page and every asset index.html references (all of the first load)."""
    html = assets.files["index.html"].body.decode()
    return ["/ui", *re.findall(r'(?:src|href)="(/ui/assets/[^"]+)"', html)]


def test_every_referenced_asset_is_served_gzipped_and_the_first_load_fits_the_budget():
    assets = Assets()
    paths = first_load(assets)
    assert len(paths) >= 9, paths
    total = 0
    for path in paths:
        status, body, headers = assets.answer(path, "gzip, deflate, br")
        assert status == 200 and headers["content-encoding"] == "gzip", path
        plain = assets.answer(path, "")[1]
        assert gzip.decompress(body) == plain and "content-encoding" not in assets.answer(path, "")[2]
        total += len(body)
    assert total <= FIRST_LOAD_BUDGET, f"first load is {total} bytes gzipped"
    assert {p.name for p in ASSET_DIR.iterdir()} == set(assets.files), "an asset no page loads, or an unknown type"


def test_no_inline_script_and_a_csp_that_forbids_it():
    assets = Assets()
    _, _, headers = assets.answer("/ui/dashboard")
    csp = headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert headers["x-content-type-options"] == "nosniff"
    html = assets.files["index.html"].body.decode()
    assert re.findall(r"<script(?![^>]*\bsrc=)", html) == [], "inline <script> would be blocked by the CSP"
    for name, asset in assets.files.items():
        if name.endswith(".js"):
            text = asset.body.decode()
            assert "innerHTML" not in text and "insertAdjacentHTML" not in text and "eval(" not in text, name


def test_an_unchanged_asset_revalidates_with_304_and_unknown_paths_are_none():
    assets = Assets()
    status, body, headers = assets.answer("/ui/assets/core.js", "gzip")
    again = assets.answer("/ui/assets/core.js", "gzip", headers["etag"])
    assert again[0] == 304 and again[1] == b"" and again[2]["etag"] == headers["etag"]
    assert assets.answer("/ui/assets/nope.js") is None
    assert assets.answer("/ui/assets/../__init__.py") is None
    assert assets.answer("/uix") is None


def test_quantile_interpolates_inside_a_bucket_like_histogram_quantile():
    bounds = [0.1, 0.5, 1.0]
    counts = [2, 6, 10, 10]           # cumulative, +Inf last
    assert quantile(0.5, bounds, counts) == pytest.approx(0.1 + 0.4 * (5 - 2) / 4)
    assert quantile(0.9, bounds, counts) == pytest.approx(0.5 + 0.5 * (9 - 6) / 4)
    assert quantile(0.1, bounds, counts) == pytest.approx(0.1 * 1 / 2)
    assert quantile(0.99, bounds, [0, 0, 0, 5]) == 1.0      # all above the last bound: its value
    assert quantile(0.5, bounds, [0, 0, 0, 0]) is None


def test_history_rows_are_rates_and_windowed_percentiles_of_the_metrics():
    metrics = ServerMetrics("m")
    history = StatsHistory(metrics, interval=1.0, window=10.0)
    history.record(EngineStats(num_running=1, prefix_cache_queries=100, prefix_cache_hits=0), now=1000.0)
    for ttft in (0.03, 0.03, 0.03, 0.3):
        metrics.children.ttft.observe(ttft)
    metrics.children.prompt_tokens.inc(200)
    metrics.children.generation_tokens.inc(50)
    row = history.record(EngineStats(num_running=3, num_waiting=2, kv_usage=0.25, prefix_cache_queries=200,
                                     prefix_cache_hits=80), now=1002.0)
    assert (row["running"], row["waiting"], row["kv_usage"]) == (3, 2, 0.25)
    assert (row["prompt_tps"], row["gen_tps"]) == (100.0, 25.0)
    assert row["prefix_hit_rate"] == 0.8                       # 80 hits of 100 lookups since the first sample
    assert row["ttft_p50"] == pytest.approx(0.02 + 0.02 * (2 - 0) / 3, abs=1e-5)   # 3 of 4 in (0.02, 0.04]
    assert row["tpot_p50"] is None                             # no inter-token gaps observed yet
    later = history.record(EngineStats(num_running=0, prefix_cache_queries=200, prefix_cache_hits=80), now=1020.0)
    assert later["ttft_p50"] is None and later["prefix_hit_rate"] is None   # nothing new in the last 10 s
    body = history.body(since=1001.0)
    assert [s["t"] for s in body["samples"]] == [1002.0, 1020.0]
    assert body["totals"]["prompt_tokens"] == 200 and body["totals"]["generation_tokens"] == 50
    assert "tokenforge:num_requests_running{model_name=\"m\"} 0.0" in metrics.render().decode()


def test_router_stats_give_each_replicas_state_load_ejections_and_prefix_placements():
    settings = RouterSettings(replicas=("http://a:1", "http://b:2"))
    metrics = RouterMetrics()
    pool = SimpleNamespace(replicas={"http://a:1": Replica("http://a:1", state="admitted", healthy=True, waiting=3),
                                     "http://b:2": Replica("http://b:2", state="ejected", reason="health check failed")})
    for reason, n in (("prefix", 3), ("overload_override", 1)):
        metrics.requests.labels("http://a:1", reason).inc(n)
    metrics.on_change(pool.replicas["http://b:2"], "ejected")
    ui = RouterUI(settings, pool, metrics)
    ui.record(now=10.0)
    metrics.requests.labels("http://a:1", "prefix").inc(2)
    row = ui.record(now=12.0)
    assert row["replicas"]["http://a:1"] == {"waiting": 3, "running": 0.0, "kv_usage": 0.0, "in_flight": 0,
                                             "admitted": True, "rps": 1.0}
    body = ui.body()
    a, b = body["replicas"]
    assert a["requests"] == {"prefix": 5.0, "overload_override": 1.0} and a["state"] == "admitted"
    assert b["state"] == "ejected" and b["events"] == {"ejected": 1.0} and b["reason"] == "health check failed"
    assert body["kind"] == "router" and body["info"]["policy"] == "prefix"
