"""The `tokenforge` command: serve | router | generate | bench | eval | doctor | cache | preprocess | train.

The one package that sees everything, and that nothing imports but the entry points (`tokenforge`,
`python -m tokenforge`, `python -m tokenforge.cli`, `python -m tokenforge.bench`). Each subcommand
has its module here with `add_<name>_parser(subparsers)`; each sets `func(args) -> int`. Engine
flags come from the config's field metadata (engine_args.py), with the playbook's spellings as
aliases (README, "Playbook flags"). Building the parser imports no torch.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

from tokenforge import __version__, envs
from tokenforge.cli.bench import add_bench_parser
from tokenforge.cli.cache import add_cache_parser
from tokenforge.cli.doctor import add_doctor_parser
from tokenforge.cli.engine_args import PLAYBOOK_NOTES, engine_kwargs
from tokenforge.cli.eval import add_eval_parser
from tokenforge.cli.generate import add_generate_parser
from tokenforge.cli.quantize import add_quantize_parser
from tokenforge.cli.parser import (
    HelpFormatter,
    Parser,
    add_planned_commands,
    add_planned_flags,
    check_planned_values,
    fill_default_help,
    refuse_planned_command,
)
from tokenforge.cli.router import add_router_parser
from tokenforge.cli.serve import add_serve_parser
from tokenforge.cli.train import add_train_parsers
from tokenforge.logs import configure_logging

LOG_LEVELS = ["debug", "info", "warning", "error"]


def _is_torchrun_worker() -> bool:
    return envs.world_size() > 1 and envs.rank() > 0


def _run_torchrun_worker(args) -> int:
    """Under torchrun every rank runs the same command: rank 0 serves (or generates), the others
    load their shard and follow rank 0's step broadcasts until it shuts down."""
    from tokenforge.config import EngineConfig  # noqa: PLC0415
    from tokenforge.executor.factory import create_worker_for_torchrun  # noqa: PLC0415

    if getattr(args, "model_tag", None) is not None and args.model is None:
        args.model = args.model_tag
    return create_worker_for_torchrun(EngineConfig.from_kwargs(**engine_kwargs(args)))


def build_parser(argv: list[str] | None = None) -> Parser:
    """The parser. Given the command line, it builds only the heavy subparsers that it names
    (a bench's or train's flags import torch), so `tokenforge --help` imports no torch; without
    one (argv None) it builds them all."""
    # `@FILE` reads more arguments from FILE, one per line (the Helm chart's ConfigMap of engine args).
    parser = Parser(prog="tokenforge", description="LLM inference and serving engine",
                    epilog=PLAYBOOK_NOTES, formatter_class=HelpFormatter, fromfile_prefix_chars="@")
    parser.add_argument("--version", action="version", version=f"tokenforge {__version__}")
    parser.add_argument("--log-level", dest="global_log_level", default=None, type=str.lower,
                        choices=LOG_LEVELS, help="as the subcommand's --log-level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_generate_parser(sub)
    add_doctor_parser(sub)
    add_serve_parser(sub)
    add_cache_parser(sub)
    add_router_parser(sub)
    add_bench_parser(sub, only="*" if argv is None else _bench_name(argv))
    add_train_parsers(sub, argv)
    add_eval_parser(sub)
    add_quantize_parser(sub)
    add_planned_commands(sub)
    for name, p in sub.choices.items():
        if "--log-level" not in p._option_string_actions and name != "bench":
            p.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)
        if "--max-num-seqs" in p._option_string_actions:   # an engine-building subcommand
            add_planned_flags(p)
        fill_default_help(p)
    return parser


def _bench_name(argv: list[str]) -> str | None:
    """The NAME of `tokenforge bench NAME ...` in argv, if any."""
    words = [a for a in argv if not a.startswith("-")]
    return words[words.index("bench") + 1] if "bench" in words[:-1] else None


# Set once a single-process `generate` ran: it shuts its engine down itself, and the interpreter's
# teardown after it (freeing torch's modules and the weights one object at a time) takes about a
# second on a 2-core machine that the OS does in milliseconds at exit.
_fast_exit = False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    refuse_planned_command(parser, argv)
    args = parser.parse_args(argv)
    check_planned_values(parser, args)
    configure_logging(args.global_log_level or getattr(args, "log_level", None) or "info", "tokenforge")
    try:
        if args.command in ("serve", "generate") and _is_torchrun_worker():
            return _run_torchrun_worker(args)
        if args.command == "generate":
            global _fast_exit
            _fast_exit = True     # not for a torchrun rank: it leaves through torch.distributed
        return args.func(args)
    except ValueError as e:   # typed, user-facing: one line, no traceback
        print(f"tokenforge: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:      # a file, a port: one line too
        print(f"tokenforge: error: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tokenforge: interrupted", file=sys.stderr)
        return 130


def bench_main(argv: list[str]) -> int:
    """`tokenforge bench NAME ...` as a function (what `python -m tokenforge.bench NAME ...` runs)."""
    return main(["bench", *argv])


def console_main() -> None:
    """The `tokenforge` script: main(), then, after a `generate` (`_fast_exit`), run the atexit
    handlers (logging, KV tiers), flush the streams and leave with os._exit."""
    rc = main()
    waiting = [t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    if not _fast_exit or waiting:
        sys.exit(rc)     # the normal exit (it also waits for a non-daemon thread that still runs)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a closed pipe (`| head`): nothing more can be written
            pass
    os._exit(rc)
