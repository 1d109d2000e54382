"""`tokenforge bench tiers`: W9, the CPU KV tier against the device prefix cache alone.

In: 64 groups x 8 requests; each group shares a 4096-token prefix, each request adds 64 unique
tokens and generates 64 (dummy Llama-3.1-8B bf16 by default), the groups in a new random order
in every round, all submitted at once, with `--kv-cache-memory 8GiB` (about 16 prefixes on the
device). Out: output tok/s of one engine with `--kv-offload-cpu-gb 64`, run with its tiers
switched off (the device prefix cache alone) and on, in the same run; the restore bandwidth
against the measured pinned host-to-device copy rate; and how many greedy outputs agree.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from tokenforge.bench.lib import harness, report, workloads


ENGINE_FLAGS = True     # cli/bench.py adds the engine flags


def add_args(p: argparse.ArgumentParser) -> None:
    harness.add_common_args(p, model=workloads.DEFAULT_GPU_MODEL, dtype="bfloat16",
                            num_prompts=None, input_len=64, output_len=64, repeats=1)
    p.add_argument("--num-groups", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=4096)
    p.set_defaults(no_baseline=True)


def h2d_gbps(size: int = 1 << 30) -> float | None:
    """Pinned host -> device copy rate (GB/s), median of 5 after 2 warm-ups; None on the CPU."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    times = []
    for i in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return size / statistics.median(times) / 1e9


def run_variant(llm, prompts, args, tiers_on: bool, label: str) -> tuple[dict, list]:
    llm.engine.set_kv_tiers_enabled(tiers_on)
    before = llm.get_stats()
    outs, seconds = harness.timed_generate(llm, prompts, harness.sampling_params(args.output_len, cache_salt=label))
    harness.check_lengths(outs, args.output_len, label)
    after = llm.get_stats()
    figures = harness.rates(len(prompts), args.prefix_len + args.input_len, args.output_len, seconds)
    figures["prefix_hit_tokens"] = after.prefix_cache_hits - before.prefix_cache_hits
    t0, t1 = before.kv_tiers, after.kv_tiers
    figures["tier_restored_tokens"] = t1.restored_tokens - t0.restored_tokens
    restored = sum(t1.bytes_restored.values()) - sum(t0.bytes_restored.values())
    restore_s, copy_s = t1.restore_sum - t0.restore_sum, t1.restore_copy_sum - t0.restore_copy_sum
    figures["tier_restored_bytes"] = restored
    figures["tier_restore_seconds"] = restore_s          # lookup to blocks in place, per request, summed
    figures["tier_restore_copy_seconds"] = copy_s        # the host-to-device copies alone
    figures["restore_gbps"] = restored / copy_s / 1e9 if copy_s > 0 else None
    figures["restore_end_to_end_gbps"] = restored / restore_s / 1e9 if restore_s > 0 else None
    figures["tier_puts"] = {k: v - t0.puts.get(k, 0) for k, v in t1.puts.items()}
    figures["tier_dropped_puts"] = {k: v - t0.dropped_puts.get(k, 0) for k, v in t1.dropped_puts.items()}
    figures["tier_hits"] = {k: v - t0.hits.get(k, 0) for k, v in t1.hits.items()}
    figures["tier_misses"] = {k: v - t0.misses.get(k, 0) for k, v in t1.misses.items()}
    figures["tier_errors"] = dict(t1.errors)
    print(f"{label}: {seconds:.2f} s, {figures['output_tok_s']:.0f} output tok/s, "
          f"restored {figures['tier_restored_tokens']} tokens", flush=True)
    return figures, harness.token_ids(outs)


def main(args: argparse.Namespace) -> dict:
    result, cfg = harness.begin("W9", args, "tiers", "for its vocabulary")
    prompts = workloads.shuffled_group_prompts(args.num_groups, args.group_size, args.prefix_len,
                                               args.input_len, cfg["vocab_size"], args.seed)
    result["workload_args"] = {"num_groups": args.num_groups, "group_size": args.group_size,
                               "prefix_len": args.prefix_len, "unique_len": args.input_len,
                               "output_len": args.output_len}
    result["h2d_gbps"] = h2d_gbps()
    overrides = {}
    if not getattr(args, "max_model_len", None):
        # The CUDA-graph decode buffers are sized by max_model_len (2048 when unset): cover W9's
        # 4096 + 64 + 64 tokens.
        overrides["max_model_len"] = args.prefix_len + args.input_len + args.output_len
    if not getattr(args, "kv_cache_memory", None):
        overrides["kv_cache_memory"] = "8GiB"
    if not getattr(args, "kv_offload_cpu_gb", None):
        overrides["kv_offload_cpu_gb"] = 64.0
    llm = harness.build_llm(args, **overrides)
    tier_flags = {k: overrides.get(k, getattr(args, k, None)) for k in ("kv_cache_memory", "kv_offload_cpu_gb")}
    result["engine"] = {**getattr(args, "resolved_engine", {}), **tier_flags}
    # Warm-up: every prefill shape and the restore path, then both timed variants on fresh salts.
    warm = prompts[: min(len(prompts), 32)]
    run_variant(llm, warm, args, True, "w9-warmup")
    dev, dev_ids = run_variant(llm, prompts, args, False, "w9-device-cache-only")
    tier, tier_ids = run_variant(llm, prompts, args, True, "w9-cpu-tier")
    harness.shutdown(llm)
    result["tokenforge"] = tier
    result["baseline"] = {"name": "tokenforge, device prefix cache alone (same engine, tiers off)", **dev}
    result["speedup"] = tier["output_tok_s"] / dev["output_tok_s"]
    if result["h2d_gbps"] and tier["restore_gbps"]:
        result["restore_fraction_of_h2d"] = tier["restore_gbps"] / result["h2d_gbps"]
    result["greedy_match_tier_vs_device"] = sum(a == b for a, b in zip(tier_ids, dev_ids))
    report.save(result, args)
    print_summary(result, len(prompts))
    return result


def print_summary(r: dict, num_prompts: int) -> None:
    t, d = r["tokenforge"], r["baseline"]
    gb = r.get("engine", {}).get("kv_offload_cpu_gb")
    rows = [[f"CPU tier {gb:g} GB" if gb else "CPU tier", t["output_tok_s"], t["total_tok_s"],
             t["tier_restored_tokens"], t["restore_gbps"]],
            ["device cache alone", d["output_tok_s"], d["total_tok_s"], 0, None]]
    report.print_table(f"W9 KV tiers  {r['model']} {r['dtype']}  {r['device']}",
                       ["variant", "output tok/s", "total tok/s", "restored tokens", "restore GB/s"], rows)
    frac = r.get("restore_fraction_of_h2d")
    print(f"speed-up with the CPU tier: {r['speedup']:.2f}x (target >= 2x); restore "
          f"{report.fmt(t['restore_gbps'], 2)} GB/s against pinned H2D {report.fmt(r['h2d_gbps'], 2)} GB/s"
          f"{f' ({frac:.0%})' if frac else ''}; greedy outputs equal: {r['greedy_match_tier_vs_device']}/{num_prompts}")
