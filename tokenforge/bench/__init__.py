"""`tokenforge bench NAME`: the benchmarks of shared/BENCHMARKING.md.

    lib/        what benches share: harness (engine, timed generate, checks), workloads, report
                (results JSON), ceilings, the HF baseline, random checkpoints, plots
    offline/    LLM(...) in this process: cpu, latency, throughput, prefix, parallel, tiers, structured, train
    serving/    `tokenforge serve` processes under HTTP load: serve, frontend (+ frontend_cpu), storm, coldstart
    kernels/    Triton kernel micro-benchmarks: attention and the decode step, GEMV, quantized GEMV

Each bench is a module with `add_args(parser)` and `main(args)` (the one calling convention; `tokenforge
bench NAME` and `python -m tokenforge.bench NAME` build the parser in cli/bench.py). A module that sets
`ENGINE_FLAGS = True` gets the engine flags (cli/engine_args.py) before its own. It checks
correctness first, measures the hardware ceilings and the HF transformers peer in the same run,
prints a table last and writes `<results-dir>/<date>-<device>-<workload>.json` (default: the current
directory; the committed records in bench/results only with an explicit --results-dir; copied to `--out`).

    ceilings    HBM read bandwidth and bf16 matmul rate (or the CPU's)
    cpu         W6: bundled SmolLM2 on the CPU, fp32 and bf16, against HF in the same run
    latency     W1: batch 1, 128 in / 256 out; ms/token p50/p99 and % of roofline
    throughput  W2 (1000 x 256/256, MFU) or W3 (--workload W3: 500 x 2048/128), batch-size sweep
    prefix      W5: shared 2048-token prefixes, prefix cache on against off
    parallel    W7: W1 and W2 at TP/PP layouts back to back, speed-up over the first layout
    coldstart   W10: cold start of `tokenforge serve` from a safetensors checkpoint written once
    tiers       W9: shared 4096-token prefixes, the CPU KV tier against the device cache alone
    serve       W4: HTTP streaming load (tokenforge.bench.serving.serve; --replay-acceptance: serve_spec)
    frontend    offline LLM vs the HTTP server back to back (server / offline), then W4 at several rates
    storm       1,000 concurrent streams through `tokenforge router`, a third disconnecting at random
    kernels     kernel micro-benchmarks (tokenforge.bench.kernels)
    train       W11: training tokens/s, MFU, peak memory (one process, or DDP / FSDP2 under torchrun)
    structured  throughput of a batch with half the requests grammar-constrained, against all free
    lora        W2 / W1 over N random rank-r adapters (all seven projections) against the bare model
    spec        batch-1 speculative decoding on the bundled model and real text (grounded / chat), per method
    spec-replay the n-gram proposer replayed offline over greedy answers: tokens per verify step, modelled speed-up
"""

from __future__ import annotations

# NAME -> the module (under tokenforge.bench) that holds its add_args(parser) and main(args).
MODULES: dict[str, str] = {
    "ceilings": "lib.ceilings", "cpu": "offline.cpu", "latency": "offline.latency", "throughput": "offline.throughput",
    "prefix": "offline.prefix", "parallel": "offline.parallel", "coldstart": "serving.coldstart",
    "tiers": "offline.tiers", "serve": "serving.serve_spec", "frontend": "serving.frontend", "storm": "serving.storm",
    "kernels": "kernels", "train": "offline.train", "structured": "offline.structured", "lora": "offline.lora",
    "spec": "offline.spec", "spec-replay": "offline.spec_replay",
}

BENCHES: dict[str, str] = {
    "ceilings": "measure HBM read bandwidth and bf16 matmul TFLOP/s (CPU: GB/s and GFLOP/s)",
    "cpu": "W6: bundled SmolLM2 on the CPU (fp32 and bf16) against HF transformers",
    "latency": "W1: batch-1 decode, ms/token p50/p99, fraction of the roofline",
    "throughput": "W2 (default) or W3 offline throughput, MFU, HF baseline, batch-size sweep plot",
    "prefix": "W5: shared-prefix throughput with the prefix cache on and off",
    "parallel": "W7: W1 and W2 under TP/PP layouts back to back (tp1,tp2,pp2), speed-ups over the first",
    "coldstart": "W10: process start to /health 200 from a real safetensors checkpoint, cold and warm",
    "tiers": "W9: KV tiers, the CPU tier against the device prefix cache alone",
    "serve": "W4: HTTP streaming serving load (TTFT, TPOT, ITL)",
    "frontend": "the API server's cost: offline LLM vs HTTP streaming back to back, then W4 rates",
    "storm": "many concurrent streams through a router, a third disconnecting; checks nothing leaks",
    "kernels": "kernel micro-benchmarks against their torch references",
    "train": "W11: training tokens/s, MFU and peak memory (FSDP2 / DDP under torchrun)",
    "structured": "throughput cost of grammar-constrained requests (half of a batch against none)",
    "lora": "multi-LoRA throughput (N random rank-r adapters) against the bare model in the same run",
    "spec": "speculative decoding on a real model and text (grounded / chat) at batch 1, against none",
    "spec-replay": "n-gram drafts' tokens per verify step replayed offline over greedy answers, modelled speed-up",
}


def bench_module(name: str) -> str:
    """The import path of bench NAME's module."""
    return f"tokenforge.bench.{MODULES[name]}"
