"""`tokenforge bench NAME`: the parser of every benchmark in tokenforge.bench.BENCHES.

Every bench has one calling convention: `add_args(parser)` adds its flags, `main(args)` runs it.
A bench module with `ENGINE_FLAGS = True` gets the engine flags first (so its add_args can set
their bench defaults), and its namespace carries `engine_kwargs_fn`, the CLI's converter, which
bench/lib/harness.py calls to build the LLM.
"""

from __future__ import annotations

import argparse
import importlib

from tokenforge.bench import BENCHES, bench_module
from tokenforge.cli.engine_args import add_engine_args, engine_kwargs

_DESCRIPTION = """Benchmarks: each checks correctness first, measures the hardware ceilings and a peer
(HF transformers) in the same run, prints a table last and writes its results JSON to
--results-dir (default: the current directory).

  tokenforge bench NAME --help     the flags of one benchmark
"""


def add_bench_parser(subparsers, only: str | None = "*") -> argparse.ArgumentParser:
    """`bench NAME [...]`. `only` names the one bench whose module (and flags) to load: the NAME on
    the command line, or None for none, so that `tokenforge --help` imports no torch; "*" loads all."""
    bench = subparsers.add_parser("bench", help="run a benchmark; results go to --results-dir (default: .)",
                                  description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = bench.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name, text in BENCHES.items():
        p = names.add_parser(name, help=text, description=text)
        if only == "*" or name == only:
            _add_bench(p, name)
    return bench


def _add_bench(p: argparse.ArgumentParser, name: str) -> None:
    try:
        module = importlib.import_module(bench_module(name))
    except ImportError as e:      # a bench whose optional dependency is missing: say so when it is run
        p.set_defaults(func=_unavailable(name, e))
        return
    if getattr(module, "ENGINE_FLAGS", False):
        add_engine_args(p)
    module.add_args(p)
    p.set_defaults(func=_runner(module.main))


def _runner(bench_main):
    def run(args: argparse.Namespace) -> int:
        args.engine_kwargs_fn = engine_kwargs
        rc = bench_main(args)
        return rc if isinstance(rc, int) else 0
    return run


def _unavailable(name: str, error: ImportError):
    def fail(args: argparse.Namespace) -> int:
        raise SystemExit(f"tokenforge bench {name} is not available: {error}")
    return fail
