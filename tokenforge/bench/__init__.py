"""`tokenforge bench NAME`: the benchmarks of shared/BENCHMARKING.md.

Each bench is a module with `add_args(parser[, add_engine_args])` and `main(args)`. It checks
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
    serve       W4: HTTP streaming load (tokenforge.bench.serve)
    frontend    offline LLM vs the HTTP server back to back (server / offline), then W4 at several rates
    storm       1,000 concurrent streams through `tokenforge router`, a third disconnecting at random
    kernels     kernel micro-benchmarks (tokenforge.bench.kernels)
    train       W11: training tokens/s, MFU, peak memory (one process, or DDP / FSDP2 under torchrun)
    structured  throughput of a batch with half the requests grammar-constrained, against all free
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys

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
}


_DESCRIPTION = """Benchmarks: each checks correctness first, measures the hardware ceilings and a peer
(HF transformers) in the same run, prints a table last and writes its results JSON to
--results-dir (default: the current directory).

  tokenforge bench NAME --help     the flags of one benchmark
"""


def _module(name: str):
    return importlib.import_module(f"tokenforge.bench.{name}")


def add_bench_args(subparsers, add_engine_args=None, only: str | None = "*") -> argparse.ArgumentParser:
    """Add `bench NAME [...]` to a CLI's subparsers.

    `only` names the one bench whose module (and flags) to load: the CLI passes the NAME on its
    command line, or None for none, so that `tokenforge --help` does not import torch. The
    default "*" loads every bench.

    `add_engine_args(parser)`, when given, adds the CLI's own engine flags (with their playbook
    aliases) to every bench; without it each bench adds a fallback set. Each NAME sets
    `args.func(args, engine_kwargs=None) -> int`, where `engine_kwargs(args)` maps those flags to
    `LLM(...)` keyword arguments.
    """
    bench = subparsers.add_parser("bench", help="run a benchmark; results go to --results-dir (default: .)",
                                  description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = bench.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name, text in BENCHES.items():
        p = names.add_parser(name, help=text, description=text)
        if only != "*" and name != only:
            continue
        try:
            module = _module(name)
        except ImportError as e:      # serve/kernels may not exist yet; say so when it is run
            p.set_defaults(func=_unavailable(name, e))
            continue
        add_args = getattr(module, "add_args", None)
        if add_args is None:
            p.add_argument("--out", default=None)
            p.add_argument("rest", nargs=argparse.REMAINDER)
        elif len(inspect.signature(add_args).parameters) >= 2:
            add_args(p, add_engine_args)
        else:
            add_args(p)
        p.set_defaults(func=_runner(module.main))
    return bench


def _runner(bench_main):
    def run(args: argparse.Namespace, engine_kwargs=None) -> int:
        args.engine_kwargs_fn = engine_kwargs
        rc = bench_main(args)
        return rc if isinstance(rc, int) else 0
    return run


def _unavailable(name: str, error: ImportError):
    def fail(args: argparse.Namespace) -> int:
        raise SystemExit(f"tokenforge bench {name} is not available: {error}")
    return fail


def main(argv: list[str] | None = None) -> int:
    """`python -m tokenforge.bench NAME ...`, the same as `tokenforge bench NAME ...`."""
    try:      # the CLI's engine flags, aliases included, so both spellings behave the same
        from tokenforge.cli import add_engine_args, engine_kwargs  # noqa: PLC0415
    except ImportError:
        add_engine_args = engine_kwargs = None
    parser = argparse.ArgumentParser(prog="tokenforge")
    add_bench_args(parser.add_subparsers(dest="command", required=True), add_engine_args)
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args, engine_kwargs)
