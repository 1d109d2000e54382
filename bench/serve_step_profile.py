"""W4's load on the engine alone, and where its steps go (device diagnostic, not a test).

The same Poisson arrivals as `bench serve` (random token prompts, forced output lengths), fed in
real time to an in-process engine core (no HTTP, no detokenizer process): TTFT / TPOT as the
engine gives them, the run's hardware floor (bench/lib/serve_floor.py) beside them, and a
torch.profiler window of steps at --profile-at seconds: each step's composition (decodes, prefill
tokens), wall time, how much of the window the device was busy, and the device time by kernel
family. The difference to a served run's TPOT is what the server adds; the difference to the
floor is the engine's.

  python bench/serve_step_profile.py --rate 16 --num-prompts 300 --out DIR [--model ...]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from pathlib import Path

import torch

from tokenforge import LLM, SamplingParams
from tokenforge.bench.lib import ceilings as ceilings_lib, serve_floor, workloads
from tokenforge.executor.executor import device_busy

FAMILIES = (   # first match wins: (family, substrings of the kernel name)
    ("decode_attention", ("_decode_split", "_decode_reduce")),
    ("prefill_attention", ("prefill",)),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90", "_gemv", "matmul")),
    ("rms_norm", ("rms",)),
    ("rotary_kv_store", ("rotary", "kv_store", "_store")),
    ("silu_mul", ("silu",)),
    ("sampler", ("argmax", "sample", "softmax", "topk", "reduce_kernel")),
    ("copies", ("copy", "memcpy", "memset", "fill", "index", "gather", "scatter", "cat")),
)


def family(name: str) -> str:
    low = name.lower()
    return next((fam for fam, keys in FAMILIES if any(k in low for k in keys)), "other")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--rate", type=float, default=16.0)
    p.add_argument("--num-prompts", type=int, default=300)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile-at", type=float, default=1e9, help="seconds into the run (default: no profile)")
    p.add_argument("--profile-steps", type=int, default=24)
    p.add_argument("--engine-arg", action="append", default=[], help="KEY=VALUE passed to LLM (ints parsed)")
    p.add_argument("--ceilings", default=None, metavar="READ_TBPS,MATMUL_TFLOPS", help="default: measured (CUDA)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = {k: (int(v) if v.lstrip("-").isdigit() else v) for k, v in (a.split("=", 1) for a in args.engine_arg)}

    if args.ceilings:
        read, mm = (float(x) for x in args.ceilings.split(","))
        ceil = {"read_bw_tbps": read, "matmul_tflops": mm}
    else:
        ceil = ceilings_lib.measure_ceilings("cuda") if torch.cuda.is_available() else None
    llm = LLM(model=args.model, load_format="dummy", dtype="bfloat16", max_model_len=args.max_model_len, **extra)
    engine = llm.engine
    cfg = workloads.load_config_dict(args.model)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(cfg["vocab_size"] // 8, cfg["vocab_size"] * 7 // 8) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    llm.generate([{"prompt_token_ids": prompts[0][:64]}] * 8, SamplingParams(max_tokens=16, ignore_eos=True),
                 use_tqdm=False)
    gaps, t = [], 0.0
    for _ in range(args.num_prompts):
        gaps.append(t)
        t += rng.expovariate(args.rate)

    composition: list[tuple[int, int]] = []          # per scheduled step: (decodes, prefill tokens)
    shapes: list[tuple[list[int], list[tuple[int, int]]]] = []   # (decode contexts, (done, new) chunks)
    schedule = engine._schedule

    def recording_schedule():
        so = schedule()
        dec = [s.start_position + 1 for s in so.sequences if s.num_tokens == 1]
        shapes.append((dec, [(s.start_position, s.num_tokens) for s in so.sequences if s.num_tokens > 1]))
        composition.append((len(dec), so.total_num_tokens - len(dec)))
        return so

    engine._schedule = recording_schedule
    # the time each step() spends waiting for the device to finish the step it reads back: near 0
    # when the host is the bottleneck (the device ran dry), a step's device slack when it is not
    collect, waited = engine.executor.collect, [0.0]

    def timed_collect(handle):
        t0 = time.perf_counter()
        out = collect(handle)
        waited[0] += time.perf_counter() - t0
        return out

    engine.executor.collect = timed_collect
    waits: list[float] = []
    first, last, count, index = {}, {}, defaultdict(int), {}
    steps: list[tuple[float, float, int]] = []       # (start, end, step index in composition)
    prof, prof_steps, prof_span = None, [], None
    nxt, done, start = 0, 0, time.perf_counter()
    while done < args.num_prompts:
        now = time.perf_counter() - start
        while nxt < args.num_prompts and gaps[nxt] <= now:
            req = llm.processor.process({"prompt_token_ids": prompts[nxt]}, params, f"r{nxt}")
            for core in req.core_requests:
                engine.add_request(core)
                index[core.request_id] = nxt
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, gaps[nxt] - now))
            continue
        if prof is None and now >= args.profile_at and not prof_steps:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
            prof_span = [time.perf_counter() - start, None]
        t0 = time.perf_counter() - start
        before = waited[0]
        outs = engine.step()
        t1 = time.perf_counter() - start
        steps.append((t0, t1, len(composition)))
        waits.append(waited[0] - before)
        if prof is not None:
            prof_steps.append(steps[-1])
            if len(prof_steps) >= args.profile_steps:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                prof_span[1] = time.perf_counter() - start
                prof.__exit__(None, None, None)
                kept, prof = prof, None
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, t1)
                last[o.request_id] = t1
                count[o.request_id] += len(o.new_token_ids)
            if o.finished:
                done += 1
    engine.drain()
    wall = time.perf_counter() - start

    ttft = [first[r] - gaps[index[r]] for r in first]
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in first if count[r] > 1]
    result = {"args": vars(args), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "wall_s": wall, "steps": len(steps), "output_tok_s": sum(count.values()) / wall,
              "ttft_ms": serve_floor.latency_ms(ttft), "tpot_ms": serve_floor.latency_ms(tpot), "ceilings": ceil,
              "num_preemptions": engine.get_stats().num_preemptions}
    if ceil:
        floor = serve_floor.floor_for_run([], cfg, ceil, gaps, args.input_len, args.output_len)
        result["floor"] = floor
        if floor and floor.get("tpot_ms", {}).get("p50"):
            result["tpot_p50_of_floor"] = floor["tpot_ms"]["p50"] / result["tpot_ms"]["p50"]
    if ceil:
        result["steps_against_model"] = against_model(steps, shapes, cfg, ceil, waits)
    if prof_steps:
        result["window"] = window_summary(kept, prof_steps, prof_span, composition, start)
    (out / "serve_step_profile.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "window"}, indent=1, default=str))
    print(json.dumps(result.get("window", {}), indent=1, default=str)[:6000])


def against_model(steps, shapes, cfg, ceil, waits) -> dict:
    """Each step's wall time (one engine.step() return to the next: with a step queued ahead,
    the device time of a step when the device is the bottleneck) beside the ideal step of the
    floor (serve_floor.step_seconds) for what that step held, by kind of step; and the time the
    host waited on the device to read that step back (`wait_ms`; ~0: the host is the bottleneck)."""
    shape = workloads.ModelShape.from_config(cfg)
    device = serve_floor.Device(ceil["read_bw_tbps"], ceil["matmul_tflops"])
    out: dict = {}
    for (_, end0, _), (_, end1, k), wait in zip(steps, steps[1:], waits[1:]):
        if k - 1 >= len(shapes) or k < 2:
            continue
        dec, chunks = shapes[k - 2]          # the step whose outputs this call returned (one queued ahead)
        kind = "decode" if not chunks else ("mixed" if dec else "prefill")
        rec = out.setdefault(kind, {"steps": 0, "wall_ms": 0.0, "model_ms": 0.0, "rows": 0, "prefill_tokens": 0,
                                    "wait_ms": 0.0})
        rec["steps"] += 1
        rec["wall_ms"] += (end1 - end0) * 1000
        rec["wait_ms"] += wait * 1000
        rec["model_ms"] += serve_floor.step_seconds(shape, device, 2, 2, dec, chunks) * 1000
        rec["rows"] += len(dec)
        rec["prefill_tokens"] += sum(n for _, n in chunks)
    for rec in out.values():
        n = rec["steps"]
        rec.update(mean_wall_ms=rec["wall_ms"] / n, mean_model_ms=rec["model_ms"] / n, mean_decodes=rec["rows"] / n,
                   mean_prefill_tokens=rec["prefill_tokens"] / n, model_of_wall=rec["model_ms"] / rec["wall_ms"],
                   mean_wait_ms=rec["wait_ms"] / n)
    return out


def step_kinds(events) -> dict:
    """The device timeline cut into steps at each step's argmax (greedy sampling ends a step);
    per kind of step (decode-only, or mixed: a prefill kernel ran), the mean span from one
    step's end to the next one's and the device time by kernel family."""
    ordered = sorted(events, key=lambda e: e.time_range.start)
    steps, cur = [], []
    for e in ordered:
        cur.append(e)
        if "ArgMax" in e.name or "argmax" in e.name:
            steps.append(cur)
            cur = []
    out: dict = {}
    for prev, step in zip(steps, steps[1:]):
        kind = "mixed" if any("_prefill_kernel" in e.name for e in step) else "decode"
        rec = out.setdefault(kind, {"steps": 0, "span_ms": 0.0, "families": defaultdict(float)})
        rec["steps"] += 1
        rec["span_ms"] += (step[-1].time_range.end - prev[-1].time_range.end) / 1000
        for e in step:
            rec["families"][family(e.name)] += (e.time_range.end - e.time_range.start) / 1000
    for rec in out.values():
        k = rec["steps"]
        rec["span_ms"] /= k
        rec["families"] = {f: v / k for f, v in sorted(rec["families"].items(), key=lambda kv: -kv[1])}
    return out


def window_summary(prof, prof_steps, span, composition, start) -> dict:
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = device_busy(events) or {"busy_ms": 0.0, "span_ms": 0.0, "busy_frac": None}
    by_family, by_name = defaultdict(float), defaultdict(lambda: [0.0, 0])
    for e in events:
        dur = e.time_range.end - e.time_range.start
        by_family[family(e.name)] += dur
        by_name[e.name[:90]][0] += dur
        by_name[e.name[:90]][1] += 1
    n = len(prof_steps)
    kinds = step_kinds(events)
    lo, hi = prof_steps[0][2], prof_steps[-1][2]
    comp = composition[max(0, lo - 1):hi]
    walls = [(b - a) * 1000 for a, b, _ in prof_steps]
    between = [(prof_steps[i + 1][0] - prof_steps[i][1]) * 1000 for i in range(n - 1)]
    return {
        "steps": n, "span_ms": (span[1] - span[0]) * 1000, "ms_per_step": (span[1] - span[0]) * 1000 / n,
        "device_span_ms": busy["span_ms"], "device_busy_ms": busy["busy_ms"], "device_busy_share": busy["busy_frac"],
        "step_call_ms": {"p50": serve_floor.latency_ms([w / 1000 for w in walls])["p50"], "max": max(walls)},
        "between_calls_ms": {"p50": serve_floor.latency_ms([b / 1000 for b in between])["p50"]},
        "decodes_mean": sum(d for d, _ in comp) / max(1, len(comp)),
        "prefill_tokens_mean": sum(p for _, p in comp) / max(1, len(comp)),
        "composition": comp,
        "device_ms_per_step_by_family": {k: v / 1000 / n for k, v in sorted(by_family.items(), key=lambda kv: -kv[1])},
        "by_step_kind": kinds,
        "top_kernels": [{"name": k, "ms_per_step": v[0] / 1000 / n, "calls": v[1]}
                        for k, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:30]],
    }


if __name__ == "__main__":
    main()
