"""The frontend-cost harness runs end to end on the CPU: the real server and engine-core process
around PacedCore, the raw-socket client in its own process, CPU accounting from /proc."""

from __future__ import annotations

from tokenforge.bench.serving import frontend_cpu


def test_paced_core_delivers_every_token_to_every_stream():
    out = frontend_cpu.main(["--streams", "6", "--input-len", "8", "--output-len", "12", "--step-ms", "5"])
    assert out["failed"] == 0
    assert out["output_tokens"] == 6 * 12
    assert 0 < out["chunks_per_s"] and 1.0 <= out["tokens_per_chunk"] <= 12
    assert out["api_cpu_us_per_token"] > 0 and out["engine_pace_tok_per_s"] == 6 / 0.005
