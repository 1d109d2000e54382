"""`tokenforge bench throughput`: W2 (1000 x 256 in / 256 out), W3 (500 x 2048 in / 128 out) or W8
(2000 x 128 in / 128 out, meant for --quantization fp8 --kv-cache-dtype fp8).

In: a model (default the Llama-3.1-8B shape, dummy bf16 weights); all prompts are submitted at
once. Out: output and total tok/s, MFU (total tok/s x 2 x matmul parameters / the matmul rate
measured in the same run; attention FLOPs reported apart), HF transformers on padded batches
(best of eager and static cache, maybe on a labelled subset), and a PNG of throughput against
batch size.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenforge.bench.lib import ceilings, harness, hf_baseline, plot, report, workloads

DEFAULT_SWEEP = "1,8,32,128,256,512"


ENGINE_FLAGS = True     # cli/bench.py adds the engine flags


def add_args(p: argparse.ArgumentParser) -> None:
    harness.add_common_args(p, model=workloads.DEFAULT_GPU_MODEL, dtype="bfloat16",
                            num_prompts=None, input_len=None, output_len=None, repeats=2)
    p.add_argument("--workload", choices=("W2", "W3", "W8"), default="W2",
                   help="W2: 1000 x 256/256 (default); W3: 500 x 2048/128 (prefill-heavy); "
                        "W8: 2000 x 128/128 (fp8 weights + fp8 KV)")
    p.add_argument("--sweep", default=None,
                   help=f"batch sizes for the throughput plot (W2 default {DEFAULT_SWEEP}; '' for none)")
    p.add_argument("--baseline-batch-size", type=int, default=None,
                   help="HF padded batch size (default 256 for W2; 64 for W3, where 256 x 2048 does not fit)")
    p.add_argument("--baseline-num-prompts", type=int, default=None,
                   help="run HF on the first N prompts only (default: two padded batches)")


def resolve_workload(args: argparse.Namespace) -> None:
    n, i, o = workloads.WORKLOADS[args.workload]
    args.num_prompts = args.num_prompts or n
    args.input_len = args.input_len or i
    args.output_len = args.output_len or o
    if args.sweep is None:
        args.sweep = DEFAULT_SWEEP if args.workload == "W2" else ""
    w2 = args.workload == "W2"
    if args.baseline_batch_size is None:
        args.baseline_batch_size = 256 if w2 else 64
    if args.baseline_num_prompts is None:
        # Whole batches of the same size, enough to time HF fairly without spending minutes of GPU.
        args.baseline_num_prompts = min(2 * args.baseline_batch_size, args.num_prompts)


def efficiency(shape: workloads.ModelShape, figures: dict, args: argparse.Namespace, matmul_tflops: float) -> dict:
    """MFU by BENCHMARKING.md's formula, and attention FLOPs beside it (not folded in)."""
    matmul_rate = figures["total_tok_s"] * shape.matmul_flops_per_token()
    attention = args.num_prompts * shape.attention_flops(args.input_len, args.output_len) / figures["seconds"]
    return {"mfu": matmul_rate / (matmul_tflops * 1e12), "matmul_tflops_achieved": matmul_rate / 1e12,
            "attention_tflops_achieved": attention / 1e12, "attention_frac": attention / (matmul_tflops * 1e12),
            "compute_floor_output_tok_s": matmul_tflops * 1e12 / shape.matmul_flops_per_token()
            * args.output_len / (args.input_len + args.output_len)}


def run_baseline(cfg: dict, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    subset = prompts[: args.baseline_num_prompts]
    result = hf_baseline.baseline_from_config(cfg, args.dtype, subset, args.output_len,
                                              args.baseline_batch_size, args.seed, harness.hf_variants(args))
    result["subset"] = f"{len(subset)} of {len(prompts)} prompts, padded batches of {args.baseline_batch_size}"
    return result


def sweep(llm, prompts: list[list[int]], args: argparse.Namespace) -> list[dict]:
    """One timed run per batch size: exactly B requests in flight, the rest of the engine as is."""
    points = []
    for b in [int(x) for x in args.sweep.split(",") if x.strip()]:
        if b > len(prompts):
            continue
        params = harness.sampling_params(args.output_len, cache_salt=f"sweep-{b}")
        outs, seconds = harness.timed_generate(llm, prompts[:b], params)
        harness.check_lengths(outs, args.output_len, f"sweep bs={b}")
        points.append({"batch_size": b, **harness.rates(b, args.input_len, args.output_len, seconds)})
        print(f"sweep bs={b}: {points[-1]['output_tok_s']:,.1f} output tok/s", flush=True)
    return points


def measure(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[harness.Timing, list[dict]]:
    llm = harness.build_llm(args)
    timing, _ = harness.run_checked(llm, prompts, args.output_len, args.repeats, "tokenforge")
    harness.profile_run(llm, prompts, args)
    points = sweep(llm, prompts, args) if args.sweep else []
    harness.shutdown(llm)
    return timing, points


def main(args: argparse.Namespace) -> dict:
    resolve_workload(args)
    result, cfg = harness.begin(args.workload, args, "throughput", "for MFU")
    shape = workloads.ModelShape.from_config(cfg)
    prompts = workloads.random_prompts(args.num_prompts, args.input_len, shape.vocab, args.seed)
    result["workload_args"] = {"num_prompts": args.num_prompts, "input_len": args.input_len,
                               "output_len": args.output_len}
    if not args.no_baseline:      # HF first and freed, so tokenforge sizes its KV from the whole GPU
        result["baseline"] = run_baseline(cfg, prompts, args)

    timing, points = measure(args, prompts)
    harness.release_memory()
    tf = {**harness.rates(args.num_prompts, args.input_len, args.output_len, timing.median), **timing.summary()}
    itl = harness.percentiles(timing.itl_ms)
    tf["ms_per_token_p50"], tf["ms_per_token_p99"] = itl[50], itl[99]
    if getattr(args, "profile", None):
        tf["profile"] = args.profile

    result["tokenforge"] = tf
    result.update(efficiency(shape, tf, args, result["ceilings"]["matmul_tflops"]))
    if result.get("baseline", {}).get("output_tok_s"):
        result["speedup_vs_baseline"] = tf["output_tok_s"] / result["baseline"]["output_tok_s"]
    if points:
        result["sweep"] = points
        result["sweep_plot"] = str(save_plot(result, points, args))
    report.save(result, args)
    print_summary(result)
    return result


def save_plot(result: dict, points: list[dict], args: argparse.Namespace) -> Path:
    folder = Path(args.results_dir or report.DEFAULT_RESULTS_DIR)
    name = report.result_filename(result).replace(".json", "-sweep.png")
    title = (f"{result['workload']} {result['model']} {result['dtype']}, {args.input_len} in / {args.output_len} out, "
             f"{result['device']}")
    baseline = result.get("baseline", {}).get("output_tok_s")
    path = plot.plot_sweep(points, folder / name, title, baseline)
    report.copy_artifact(path, args)
    return path


def print_summary(r: dict) -> None:
    tf = r["tokenforge"]
    rows = [["tokenforge", tf["output_tok_s"], tf["total_tok_s"], f"{r['mfu']:.1%}"]]
    if r.get("baseline", {}).get("output_tok_s"):
        b = r["baseline"]
        rows.append([f"{b['name']} ({b['subset']})", b["output_tok_s"], b["total_tok_s"], None])
    for p in r.get("sweep", []):
        rows.append([f"  tokenforge bs={p['batch_size']}", p["output_tok_s"], p["total_tok_s"], None])
    report.print_table(f"{r['workload']} throughput  {r['model']} {r['dtype']}  {r['device']}  "
                       f"({ceilings.describe(r['ceilings'])})",
                       ["variant", "output tok/s", "total tok/s", "MFU"], rows)
    print(f"attention: {r['attention_tflops_achieved']:.3g} TFLOP/s ({r['attention_frac']:.1%} of matmul rate); "
          f"compute floor {r['compute_floor_output_tok_s']:,.0f} output tok/s")
    if "speedup_vs_baseline" in r:
        print(f"tokenforge / HF: {r['speedup_vs_baseline']:.2f}x")
