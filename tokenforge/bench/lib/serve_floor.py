"""The hardware floor of a serving run: the TTFT and TPOT an ideal engine would give the same
arrivals on the same device (no torch).

In: the run's arrival times, prompt and output lengths, the model's shape (`ModelShape`), the
weight and KV bytes per value, the device's measured ceilings (read TB/s, matmul TFLOP/s) and the
engine's step limits (tokens and sequences a step). Out: the floor's TTFT / TPOT percentiles and
duration, so a W4 result can be put against what the card allows at that load
(shared/BENCHMARKING.md: each figure beside the limit it can reach).

The ideal engine schedules as ours does (every running decode each step; prefill chunks fill the
step's token budget, first come first served, with chunked prefill), has no host time and no KV
limit, and runs each step at the ceilings: the linears take the longer of reading the weights and
their FLOPs at the matmul rate; decode attention reads every running sequence's KV at the read
rate; prefill attention costs its causal FLOPs at the matmul rate. Nothing overlaps across those
three (separate kernels), which every engine we know shares. So a measured TPOT over the floor's
says how much of the card the engine left unused at that load; the floor itself can be well
above a batch-1 step: at 16 req/s of 1024 / 1024 on an 8B model most of a step is KV reads and
the prefill of arriving requests.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from tokenforge.bench.lib.workloads import ModelShape


@dataclass(frozen=True, slots=True)
class Device:
    read_tbps: float
    matmul_tflops: float


@dataclass(slots=True)
class _Req:
    arrival: float
    prefilled: int = 0
    generated: int = 0
    first: float = math.nan
    end: float = math.nan


@dataclass(frozen=True, slots=True)
class Engine:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 512


@dataclass(slots=True)
class Floor:
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    duration_s: float = 0.0
    steps: int = 0

    def summary(self) -> dict:
        return {"ttft_ms": latency_ms(self.ttft_s), "tpot_ms": latency_ms(self.tpot_s), "duration_s": self.duration_s,
                "steps": self.steps}


def latency_ms(values: list[float]) -> dict:
    """Mean, p50 and p99 (nearest rank) of `values` in seconds, as milliseconds; None when empty.
    The one percentile rule of the serving benches, so a run and its floor compare like for like."""
    ordered = sorted(values)
    if not ordered:
        return {"mean": None, "p50": None, "p99": None}

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] * 1000

    return {"mean": sum(ordered) / len(ordered) * 1000, "p50": pct(0.50), "p99": pct(0.99)}


def step_seconds(shape: ModelShape, device: Device, weight_bytes: float, kv_bytes: float,
                 decode_contexts: list[int], chunks: list[tuple[int, int]]) -> float:
    """One ideal step: `decode_contexts` (each running decode's KV length), `chunks` (each prefill
    chunk's (already computed, new) tokens), `weight_bytes` / `kv_bytes` per value."""
    read, flops = device.read_tbps * 1e12, device.matmul_tflops * 1e12
    rows = len(decode_contexts) + sum(new for _, new in chunks)
    sampled = len(decode_contexts) + len(chunks)          # the lm_head runs on the rows that sample
    body = shape.layers * shape.layer_linear_params
    linears = max(shape.total_params * weight_bytes / read,
                  (2 * body * rows + 2 * shape.vocab * shape.hidden * sampled) / flops)
    kv_per_token = shape.kv_bytes_per_token(1) * kv_bytes
    attention_read = sum(decode_contexts) * kv_per_token / read
    per_pair = 4 * shape.layers * shape.heads * shape.head_dim    # QK^T and PV, one query and one key
    prefill_attention = sum(per_pair * new * (done + (new + 1) / 2) for done, new in chunks) / flops
    return linears + attention_read + prefill_attention


def simulate(arrivals: list[float], input_len: int, output_len: int, shape: ModelShape, device: Device,
             weight_bytes: float = 2, kv_bytes: float = 2, engine: Engine = Engine()) -> Floor:
    """The ideal engine over `arrivals` (seconds from the run's start, any order)."""
    pending = [_Req(a) for a in sorted(arrivals)]
    waiting: deque[_Req] = deque()
    running: list[_Req] = []
    floor, now, nxt = Floor(), 0.0, 0
    while nxt < len(pending) or waiting or running:
        while nxt < len(pending) and pending[nxt].arrival <= now:
            waiting.append(pending[nxt])
            nxt += 1
        if not waiting and not running:
            now = pending[nxt].arrival
            continue
        decodes = [r for r in running if r.prefilled == input_len]
        budget = engine.max_num_batched_tokens - len(decodes)
        chunks: list[tuple[_Req, int]] = []
        for r in running:                       # chunks of prompts already started, then new ones
            if r.prefilled < input_len and budget > 0:
                chunks.append((r, min(input_len - r.prefilled, budget)))
                budget -= chunks[-1][1]
        while waiting and budget > 0 and len(running) < engine.max_num_seqs:
            r = waiting.popleft()
            running.append(r)
            chunks.append((r, min(input_len, budget)))
            budget -= chunks[-1][1]
        now += step_seconds(shape, device, weight_bytes, kv_bytes, [input_len + r.generated for r in decodes],
                            [(r.prefilled, n) for r, n in chunks])
        floor.steps += 1
        for r in decodes:
            r.generated += 1
        for r, n in chunks:
            r.prefilled += n
            if r.prefilled == input_len:        # the prompt's last chunk samples the first token
                r.generated, r.first = 1, now
                floor.ttft_s.append(now - r.arrival)
        for r in [r for r in running if r.generated >= output_len]:
            r.end = now
            running.remove(r)
            if output_len > 1:
                floor.tpot_s.append((r.end - r.first) / (output_len - 1))
    floor.duration_s = now - (min(arrivals) if arrivals else 0.0)
    return floor


_WEIGHT_BYTES = {"fp8": 1, "int8": 1, "w8a8": 1, "int4": 0.5, "awq": 0.5, "gptq": 0.5}
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "auto": 2}


def flag(words: list[str], name: str) -> str | None:
    """The value of `--name V` or `--name=V` among a command line's words (the last one wins)."""
    value = None
    for i, word in enumerate(words):
        key, eq, rest = word.partition("=")
        if key == name:
            value = rest if eq else (words[i + 1] if i + 1 < len(words) else None)
    return value


def floor_for_run(serve_words: list[str], model_config: dict | None, ceilings: dict | None, arrivals: list[float],
                  input_len: int, output_len: int) -> dict | None:
    """The floor of a W4 run against a server started with `serve_words` (its flags), or None
    when the model's config or the device's ceilings are unknown."""
    if not model_config or not ceilings or not arrivals:
        return None
    dtype = _DTYPE_BYTES.get(flag(serve_words, "--dtype") or "auto", 2)
    weight = _WEIGHT_BYTES.get((flag(serve_words, "--quantization") or "").lower(), dtype)
    kv = 1 if (flag(serve_words, "--kv-cache-dtype") or "").startswith("fp8") else dtype
    tokens, seqs = flag(serve_words, "--max-num-batched-tokens"), flag(serve_words, "--max-num-seqs")
    base = Engine()         # the CUDA defaults, as the server resolves them without flags
    engine = Engine(int(tokens) if tokens else base.max_num_batched_tokens, int(seqs) if seqs else base.max_num_seqs)
    device = Device(ceilings["read_bw_tbps"], ceilings["matmul_tflops"])
    result = simulate(arrivals, input_len, output_len, ModelShape.from_config(model_config), device, weight, kv, engine)
    return {**result.summary(), "device": {"read_tbps": device.read_tbps, "matmul_tflops": device.matmul_tflops},
            "weight_bytes": weight, "kv_bytes": kv, "max_num_batched_tokens": engine.max_num_batched_tokens,
            "max_num_seqs": engine.max_num_seqs}


__all__ = ["Device", "Engine", "Floor", "flag", "floor_for_run", "latency_ms", "simulate", "step_seconds"]
