"""The hardware floor of a serving run (bench/lib/serve_floor.py): one request's TTFT and TPOT
equal the step formula summed by hand; chunked prompts take one step per chunk; more load never
lowers the floor; and `bench serve` puts the floor beside the measured TPOT from the launch flags."""

from __future__ import annotations

import math
import random
from argparse import Namespace

import pytest

from tokenforge.bench.lib.serve_floor import Device, Engine, flag, floor_for_run, simulate, step_seconds
from tokenforge.bench.lib.workloads import ModelShape, load_config_dict

LLAMA = load_config_dict("llama-3.1-8b")
SHAPE = ModelShape.from_config(LLAMA)
H200 = Device(4.19, 790.0)


def _weights_s(device=H200, weight_bytes=2):
    return SHAPE.total_params * weight_bytes / (device.read_tbps * 1e12)


def test_one_request_is_the_step_formula_by_hand():
    inp, out = 100, 20
    floor = simulate([0.0], inp, out, SHAPE, H200)
    read, flops = H200.read_tbps * 1e12, H200.matmul_tflops * 1e12
    body = SHAPE.layers * SHAPE.layer_linear_params
    prefill = (max(_weights_s(), (2 * body * inp + 2 * SHAPE.vocab * SHAPE.hidden) / flops)
               + 4 * SHAPE.layers * SHAPE.heads * SHAPE.head_dim * inp * (inp + 1) / 2 / flops)
    kv = SHAPE.kv_bytes_per_token(2)
    decodes = [_weights_s() + (inp + g) * kv / read for g in range(1, out)]     # batch 1: weight-read bound
    assert floor.ttft_s == [pytest.approx(prefill, rel=1e-12)]
    assert floor.tpot_s == [pytest.approx(sum(decodes) / (out - 1), rel=1e-12)]
    assert floor.steps == out and floor.duration_s == pytest.approx(prefill + sum(decodes), rel=1e-12)


def test_a_long_prompt_takes_a_step_per_chunk_and_decodes_ride_along():
    floor = simulate([0.0, 0.0], 5000, 3, SHAPE, H200, engine=Engine(max_num_batched_tokens=2048))
    # steps: 2048 | 2048 | 904 (first prompt done) + 1144 | decode + 2047 | decode (first done) +
    # 1809 (second prompt done) | decode | decode (second done)
    assert len(floor.ttft_s) == 2 and floor.ttft_s[0] < floor.ttft_s[1]
    assert floor.steps == 7
    assert len(floor.tpot_s) == 2 and all(t > 0 for t in floor.tpot_s)


def test_more_load_never_lowers_the_floor_and_every_request_finishes():
    rnd = random.Random(3)
    gaps = [rnd.expovariate(1.0) for _ in range(120)]
    p50 = []
    for rate in (2, 16, 128):
        arrivals = [sum(gaps[:i]) / rate for i in range(120)]
        floor = simulate(arrivals, 512, 64, SHAPE, H200)
        assert len(floor.tpot_s) == len(floor.ttft_s) == 120
        p50.append(floor.summary()["tpot_ms"]["p50"])
    assert p50 == sorted(p50) and p50[-1] > 1.2 * p50[0]


def test_a_big_batch_is_compute_bound_and_fp8_kv_halves_the_attention_reads():
    contexts = [2048] * 256
    bf16 = step_seconds(SHAPE, H200, 2, 2, contexts, [])
    fp8 = step_seconds(SHAPE, H200, 2, 1, contexts, [])
    kv_read = 256 * 2048 * SHAPE.kv_bytes_per_token(2) / (H200.read_tbps * 1e12)
    assert bf16 - fp8 == pytest.approx(kv_read / 2, rel=1e-9)
    compute = step_seconds(SHAPE, H200, 2, 2, [], [(0, 8192)])
    assert compute > 10 * _weights_s()           # 8192 prompt rows: FLOPs, not the weight read, bound it


def test_flags_pick_bytes_and_limits():
    words = ["--model", "llama-3.1-8b", "--kv-cache-dtype=fp8", "--quantization", "fp8", "--max-num-seqs", "64"]
    assert flag(words, "--kv-cache-dtype") == "fp8" and flag(words, "--max-num-seqs") == "64"
    assert flag(words, "--dtype") is None
    out = floor_for_run(words, LLAMA, {"read_bw_tbps": 4.19, "matmul_tflops": 790.0}, [0.0, 0.1], 64, 8)
    assert (out["weight_bytes"], out["kv_bytes"], out["max_num_seqs"], out["max_num_batched_tokens"]) == (1, 1, 64, 8192)
    assert floor_for_run(words, None, {"read_bw_tbps": 1, "matmul_tflops": 1}, [0.0], 8, 2) is None
    assert floor_for_run(words, LLAMA, None, [0.0], 8, 2) is None


def test_bench_serve_puts_the_floor_beside_the_measured_tpot():
    from tokenforge.bench.serving.serve import _floor                          # noqa: PLC0415
    measured = {"arrivals_s": [0.0, 0.05, 0.1], "input_len": 128, "output_len": 16,
                "tpot_ms": {"p50": 20.0, "p99": 30.0}}
    args = Namespace(launch="--model llama-3.1-8b --load-format dummy --dtype bfloat16")
    floor = _floor(args, "served-name", measured, {"read_bw_tbps": 4.19, "matmul_tflops": 790.0})
    expected = simulate([0.0, 0.05, 0.1], 128, 16, SHAPE, H200).summary()["tpot_ms"]["p50"]
    assert floor["tpot_ms"]["p50"] == pytest.approx(expected)
    assert floor["tpot_p50_of_floor"] == pytest.approx(expected / 20.0) and 0 < floor["tpot_p50_of_floor"] < 1
    assert _floor(Namespace(launch=None), "no-such-model", measured, {"read_bw_tbps": 1, "matmul_tflops": 1}) is None
    assert not math.isnan(floor["duration_s"])
