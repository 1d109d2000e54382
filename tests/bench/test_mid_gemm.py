"""The mid-batch GEMM bench (bench/kernels/mid_gemm.py) on the CPU: the padding choice and a smoke
run's JSON."""

from __future__ import annotations

import json

from tokenforge.bench.kernels import mid_gemm


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
        assert row["floor_us"] > 0 and row["cublas"]["us"] > 0 and row["best"] in ("cublas", "pad")
        assert "cublaslt" not in row            # the CPU has one BLAS
