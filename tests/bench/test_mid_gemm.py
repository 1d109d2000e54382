"""The mid-batch GEMM bench (bench/kernels/mid_gemm.py) on the CPU: its candidate pruning, the
padding choice, and a smoke run's JSON (Triton rows through the interpreter when TRITON_INTERPRET=1,
else skipped)."""

from __future__ import annotations

import json

from tokenforge.bench.kernels import mid_gemm
from tokenforge.bench.kernels.serving_step import SHAPES
from tokenforge.kernels.gemm import check_config


def test_candidates_are_compact_and_valid_for_every_8b_shape():
    for _, n, k in SHAPES:
        cands = mid_gemm.candidates(n)
        assert 12 <= len(cands) <= 20 and len(set(cands)) == len(cands)
        assert all(check_config(c, k) is None for c in cands)
        assert any(c.split_k > 1 for c in cands) == (n == 4096)


def test_pruning_drops_wasteful_tiles_and_split_k_past_the_sms():
    cfg = mid_gemm._cfg
    assert mid_gemm.fits(cfg(16, 128, 128, 4, swap=True), 16, 4096, 4096, 132)
    assert not mid_gemm.fits(cfg(128, 128, 64, 4), 16, 4096, 4096, 132)          # 112 of 128 rows padding
    assert not mid_gemm.fits(cfg(16, 128, 128, 4, swap=True), 256, 4096, 4096, 132)  # 16 row tiles
    split = cfg(16, 128, 128, 4, split=4, swap=True)
    assert mid_gemm.fits(split, 16, 4096, 4096, 132)                           # 32 tiles on 132 SMs
    assert not mid_gemm.fits(split, 128, 4096, 4096, 132)                      # 256 tiles already fill them
    for m in mid_gemm.MS:                    # every (shape, M) keeps several candidates
        for _, n, k in SHAPES:
            assert sum(mid_gemm.fits(c, m, n, k, 132) for c in mid_gemm.candidates(n)) >= 4, (m, n)


def test_pad_is_the_smallest_larger_m_that_beats_this_one():
    us = {16: 50.0, 32: 52.0, 448: 296.0, 480: 300.0, 512: 160.0}
    assert mid_gemm.pad_choice(us, 448) == 512
    assert mid_gemm.pad_choice(us, 32) is None and mid_gemm.pad_choice(us, 512) is None
    assert mid_gemm.pad_choice({16: 60.0, 32: 55.0, 64: 40.0}, 16) == 32


def test_smoke_run_writes_rows_with_floors_and_a_best(tmp_path):
    result = mid_gemm.run(str(tmp_path), smoke=True)
    saved = json.loads((tmp_path / "kernels_mid_gemm.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"])) and len(saved["rows"]) == 4
    for row in saved["rows"]:
        assert "error" not in row, row
        assert row["floor_us"] > 0 and row["cublas"]["us"] > 0 and row["best"] in ("cublas", "triton", "pad")
        assert "us" in row["triton"] or "skipped" in row["triton"]
        assert all("us" in t for t in row["triton_configs"]), row["triton_configs"]
