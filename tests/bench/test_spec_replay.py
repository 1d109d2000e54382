"""bench/lib/ngram_replay.py's replay and cost model on hand-made answers, and `tokenforge bench
spec-replay` end to end on saved ids (no model)."""

from __future__ import annotations

import json

import pytest

from tokenforge.bench.lib import ngram_replay as nr
from tokenforge.cli.main import bench_main


def test_a_perfect_proposer_emits_k_plus_one_a_step_and_none_one():
    c = nr.Continuation(prompt=[7, 7], output=list(range(10, 20)))     # 10 tokens: 9 after the prefill's

    def oracle(history, k):
        return c.output[len(history) - 2:len(history) - 2 + k]

    st = nr.replay([c], oracle, 3)
    assert (st.decodes, st.steps, st.empty, st.tokens) == (9, 3, 0, 9)      # 4 + 4 + 1 (the last: a bonus)
    st = nr.replay([c], lambda history, k: [], 3)
    assert (st.steps, st.empty, st.tokens_per_step) == (9, 9, 1.0)
    assert st.speedup(1.5, burst=False) == 1.0                              # empty steps are plain decodes
    assert st.speedup(1.5, burst=True) == pytest.approx(1 / 1.5)            # a burst runs its rows anyway


def test_verify_cost_is_linear_through_the_measured_points():
    assert nr.verify_cost(4) == 1.25 and nr.verify_cost(16) == 1.8
    assert nr.verify_cost(8) == pytest.approx(1.25 + 4 * 0.55 / 12)
    assert nr.verify_cost(32) == pytest.approx(1.8 + 16 * 0.55 / 12)
    assert nr.verify_cost(2, {1: 1.1, 3: 1.3, 9: 2.0}) == pytest.approx(1.2)


def test_latest_match_is_the_rule_before_the_tie_break():
    history = [10, 11, 12, 5, 20, 30, 31, 5, 40, 11, 12, 13, 5]
    assert nr.latest_match(1, 4)(history, 2) == [40, 11]


def test_the_bench_replays_saved_ids(tmp_path):
    passage = list(range(100, 140))
    rows = [{"prompt": [1, 2] + passage + [3], "output": passage[:12] + [99] + passage[13:30]}]
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps({"grounded": rows}))
    bench_main(["spec-replay", "--ids", str(ids), "--workload", "grounded", "--k", "4,16",
                "--results-dir", str(tmp_path / "res")])
    (path,) = (tmp_path / "res").glob("*.json")
    result = json.loads(path.read_text())
    got = {(r["k"], r["proposer"]): r for r in result["rows"]}
    assert set(got) == {(k, p) for k in (4, 16) for p in ("burst-latest", "burst", "host-latest", "host")}
    # the answer copies the passage but for one replaced token: resync drafts past it, the latest rule can't
    assert got[16, "burst"]["tokens_per_step"] > got[16, "burst-latest"]["tokens_per_step"]
    assert got[16, "burst"]["empty_share"] == 0
