"""`tokenforge eval perplexity | quality`: their flags (the engine's, and the text and windows).

The runs live in tokenforge/eval and get the engine keyword arguments through engine_kwargs.
"""

from __future__ import annotations

import argparse

from tokenforge.cli.engine_args import PLAYBOOK_NOTES, add_engine_args, engine_kwargs


def add_eval_parser(subparsers, epilog: str | None = PLAYBOOK_NOTES) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("eval", help="model quality: sliding-window perplexity, the quantization table")
    names = parser.add_subparsers(dest="eval", metavar="NAME", required=True)
    ppl = names.add_parser("perplexity", help="sliding-window perplexity of a text with the engine flags",
                           epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(ppl, compare_hf=True)
    add_engine_args(ppl)
    ppl.set_defaults(func=_run("run_perplexity"))
    quality = names.add_parser("quality", help="perplexity of every quantization/pruning mode vs float32")
    _add_common(quality)
    add_engine_args(quality)
    quality.set_defaults(func=_run("run_quality"))
    return parser


def _add_common(p: argparse.ArgumentParser, compare_hf: bool = False) -> None:
    g = p.add_argument_group("eval")
    g.add_argument("--text-file", required=True, help="plain UTF-8 text to score")
    g.add_argument("--window", type=int, default=512, help="tokens per window (default %(default)s)")
    g.add_argument("--stride", type=int, default=256,
                   help="tokens between window starts; each window scores only tokens no earlier one did "
                        "(default %(default)s)")
    g.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    if compare_hf:
        g.add_argument("--compare-hf", action="store_true",
                       help="also score the same windows with HF transformers (float32) and report the difference")


def _run(name: str):
    def run(args: argparse.Namespace) -> int:
        import tokenforge.eval as evaluation  # noqa: PLC0415 - the engine: only when run

        return getattr(evaluation, name)(args, engine_kwargs)
    return run
