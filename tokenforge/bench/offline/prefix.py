"""`tokenforge bench prefix`: W5, shared prefixes with the prefix cache on against off.

In: 32 groups x 16 requests; each group shares a 2048-token prefix, each request adds 128 unique
tokens and generates 128 (dummy Llama-3.1-8B bf16 by default). All are submitted at once, the
groups interleaved. Out: throughput of two engines run one after the other (cache on, then off,
freeing the GPU in between), the speed-up, the cache hit rate, and how many greedy outputs agree.
"""

from __future__ import annotations

import argparse

from tokenforge.bench.lib import harness, report, workloads


ENGINE_FLAGS = True     # cli/bench.py adds the engine flags


def add_args(p: argparse.ArgumentParser) -> None:
    harness.add_common_args(p, model=workloads.DEFAULT_GPU_MODEL, dtype="bfloat16",
                            num_prompts=None, input_len=128, output_len=128, repeats=2)
    p.add_argument("--num-groups", type=int, default=32)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=2048)
    p.set_defaults(no_baseline=True)


def run_variant(args: argparse.Namespace, prompts: list[list[int]], caching: bool) -> tuple[dict, list]:
    label = f"prefix-cache-{'on' if caching else 'off'}"
    llm = harness.build_llm(args, enable_prefix_caching=caching)
    queries0 = getattr(llm.get_stats(), "prefix_cache_queries", 0)
    timing, outs = harness.run_checked(llm, prompts, args.output_len, args.repeats, label)
    queries = getattr(llm.get_stats(), "prefix_cache_queries", 0) - queries0
    harness.shutdown(llm)
    input_len = args.prefix_len + args.input_len
    figures = {**harness.rates(len(prompts), input_len, args.output_len, timing.median), **timing.summary()}
    itl = harness.percentiles(timing.itl_ms)
    figures["ms_per_token_p50"], figures["ms_per_token_p99"] = itl[50], itl[99]
    figures["prefix_cache_queries"] = queries
    return figures, harness.token_ids(outs)


def main(args: argparse.Namespace) -> dict:
    result, cfg = harness.begin("W5", args, "prefix", "for its vocabulary")
    prompts = workloads.shared_prefix_prompts(args.num_groups, args.group_size, args.prefix_len,
                                              args.input_len, cfg["vocab_size"], args.seed)
    result["workload_args"] = {"num_groups": args.num_groups, "group_size": args.group_size,
                               "prefix_len": args.prefix_len, "unique_len": args.input_len,
                               "output_len": args.output_len}
    on, on_ids = run_variant(args, prompts, caching=True)
    harness.release_memory()      # the first engine is gone; give its GPU memory to the second
    off, off_ids = run_variant(args, prompts, caching=False)
    harness.release_memory()
    hit_tokens = on["prefix_hit_tokens"][0] if on["prefix_hit_tokens"] else 0
    on["prefix_hit_rate"] = hit_tokens / sum(len(p) for p in prompts)
    result["tokenforge"] = on
    result["baseline"] = {"name": "tokenforge, prefix cache off", **off}
    result["speedup"] = on["output_tok_s"] / off["output_tok_s"]
    # Cached and recomputed prefixes differ only by rounding; greedy on random weights may flip.
    result["greedy_match_on_vs_off"] = sum(a == b for a, b in zip(on_ids, off_ids))
    report.save(result, args)
    print_summary(result, len(prompts))
    return result


def print_summary(r: dict, num_prompts: int) -> None:
    on, off = r["tokenforge"], r["baseline"]
    rows = [["prefix cache on", on["output_tok_s"], on["total_tok_s"], f"{on['prefix_hit_rate']:.1%}"],
            ["prefix cache off", off["output_tok_s"], off["total_tok_s"], None]]
    report.print_table(f"W5 shared prefix  {r['model']} {r['dtype']}  {r['device']}",
                       ["variant", "output tok/s", "total tok/s", "hit rate"], rows)
    print(f"speed-up with the prefix cache: {r['speedup']:.2f}x; greedy outputs equal on/off: "
          f"{r['greedy_match_on_vs_off']}/{num_prompts}")
