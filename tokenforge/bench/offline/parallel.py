"""`tokenforge bench parallel`: W7, W1 and W2 under several parallel layouts, back to back.

In: a model (default the Llama-3.1-8B shape, dummy bf16) and layouts such as `tp1,tp2,pp2,tp2pp2`.
Out: per layout W1 (batch 1, 128 in / 256 out: tok/s, ms/token p50) and W2 (N prompts, 256 / 256,
all at once: output tok/s), each layout's ratio to the first, and the batch-1 roofline of one
GPU. Every layout gets the same prompts; each engine is built, measured and shut down before the
next one starts, so all of them see the same free GPUs.
"""

from __future__ import annotations

import argparse
import re

from tokenforge.bench.lib import ceilings, harness, report, workloads


ENGINE_FLAGS = True     # cli/bench.py adds the engine flags


def add_args(p: argparse.ArgumentParser) -> None:
    harness.add_common_args(p, model=workloads.DEFAULT_GPU_MODEL, dtype="bfloat16",
                            num_prompts=256, input_len=256, output_len=256, repeats=1)
    g = p.add_argument_group("parallel")
    g.add_argument("--layouts", default="tp1,tp2,pp2", help="comma-separated: tp<N>, pp<N> or tp<N>pp<M>")
    g.add_argument("--w1-repeats", type=int, default=2)
    g.add_argument("--skip-w2", action="store_true")


def parse_layout(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(?:tp(\d+))?(?:pp(\d+))?", text.strip())
    if not m or not (m.group(1) or m.group(2)):
        raise SystemExit(f"bad layout {text!r}: use tp<N>, pp<N> or tp<N>pp<M>")
    return int(m.group(1) or 1), int(m.group(2) or 1)


def measure_layout(args: argparse.Namespace, tp: int, pp: int, w1: list[list[int]], w2: list[list[int]]) -> dict:
    label = f"tp{tp}pp{pp}"
    # --pipeline-steps applies to the pipelined layouts only (the default there: PP steps in flight).
    steps = {"pipeline_steps": 1} if pp == 1 else {}
    llm = harness.build_llm(args, tensor_parallel_size=tp, pipeline_parallel_size=pp, **steps)
    out = {"tp": tp, "pp": pp, "engine": dict(getattr(args, "resolved_engine", {})),
           "startup_phases": dict(getattr(llm.engine, "startup_phases", {}))}
    timing, _ = harness.run_checked(llm, w1, 256, args.w1_repeats, f"{label}-W1")
    p50 = harness.percentiles(timing.itl_ms)
    out["W1"] = {**harness.rates(1, 128, 256, timing.median), "ms_per_token_p50": p50[50],
                 "ms_per_token_p99": p50[99], **timing.summary()}
    if not args.skip_w2:
        timing, _ = harness.run_checked(llm, w2, args.output_len, args.repeats, f"{label}-W2")
        out["W2"] = {**harness.rates(len(w2), args.input_len, args.output_len, timing.median), **timing.summary()}
    out["max_steps_in_flight"] = llm.engine.max_steps_in_flight
    harness.shutdown(llm)
    del llm
    harness.release_memory()
    return out


def main(args: argparse.Namespace) -> dict:
    result, cfg = harness.begin("W7", args, "parallel", "for the prompts' vocabulary")
    shape = workloads.ModelShape.from_config(cfg)
    w1 = workloads.random_prompts(1, 128, shape.vocab, args.seed)
    w2 = workloads.random_prompts(args.num_prompts, args.input_len, shape.vocab, args.seed + 1)
    result["workload_args"] = {"w1": "1 x 128/256", "w2": f"{args.num_prompts} x {args.input_len}/{args.output_len}"}
    layouts = [parse_layout(t) for t in args.layouts.split(",")]
    result["layouts"] = {}
    for tp, pp in layouts:
        result["layouts"][f"tp{tp}pp{pp}"] = measure_layout(args, tp, pp, w1, w2)
    per_token = shape.decode_bytes_per_token(args.dtype, 128 + 128)
    result["roofline_1gpu_tok_s"] = result["ceilings"]["read_bw_tbps"] * 1e12 / per_token
    base = next(iter(result["layouts"].values()))
    for fig in result["layouts"].values():
        for w in ("W1", "W2"):
            if w in fig and w in base:
                fig[f"{w}_speedup"] = fig[w]["output_tok_s"] / base[w]["output_tok_s"]
    report.save(result, args)
    print_summary(result)
    return result


def print_summary(r: dict) -> None:
    rows = []
    for name, fig in r["layouts"].items():
        w2 = fig.get("W2", {})
        rows.append([name, fig["W1"]["output_tok_s"], fig["W1"]["ms_per_token_p50"], fig.get("W1_speedup"),
                     w2.get("output_tok_s"), fig.get("W2_speedup"), fig["startup_phases"].get("total")])
    report.print_table(
        f"W7 parallel  {r['model']} {r['dtype']}  {r['device']}  ({ceilings.describe(r['ceilings'])}); "
        f"1-GPU batch-1 roofline {r['roofline_1gpu_tok_s']:.0f} tok/s",
        ["layout", "W1 tok/s", "ms/tok p50", "W1 x", "W2 out tok/s", "W2 x", "start s"], rows)
