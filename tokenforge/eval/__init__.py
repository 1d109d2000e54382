"""`tokenforge eval perplexity | quality`: model quality through the engine.

    tokenforge eval perplexity --text-file tests/data/quality_text.txt --kv-cache-dtype fp8
    tokenforge eval quality --text-file tests/data/quality_text.txt --json-out quality.json

`perplexity` takes the engine flags (--quantization, --kv-cache-dtype, --dtype, ...), prints a
short summary and then, as its last line, one JSON object; `--json-out` also writes it to a file.
`quality` runs every variant of quality.VARIANTS on the same text and prints the table.
Their flags are in cli/eval.py; the runs take the namespace and the CLI's engine_kwargs(args).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenforge.eval.perplexity import PerplexityResult, check_window, perplexity, sliding_windows, text_token_ids
from tokenforge.eval.quality import VARIANTS, format_table, quality_table

__all__ = ["PerplexityResult", "VARIANTS", "perplexity", "quality_table", "run_perplexity", "run_quality",
           "sliding_windows"]

# Engine flags recorded beside the figure (those a quality comparison varies).
RECORDED_FLAGS = ("dtype", "quantization", "kv_cache_dtype", "sparsity", "prune_rate")


def eval_engine_kwargs(args: argparse.Namespace, engine_kwargs) -> dict:
    """The engine flags, with a context and batch sized for windows when the user set none: the
    KV cache then holds 16 windows instead of the default budget (1 GiB on the CPU)."""
    kwargs = engine_kwargs(args)
    if kwargs.get("max_model_len") is None:
        kwargs["max_model_len"] = args.window + 16          # a window plus the one generated token
    if kwargs.get("max_num_seqs") is None:
        kwargs["max_num_seqs"] = 16
    return kwargs


def _read_text(path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--text-file {path!r} does not exist")
    text = p.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"--text-file {path!r} is empty")
    return text


def _emit(record: dict, json_out: str | None) -> None:
    line = json.dumps(record)
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(line, flush=True)


def run_perplexity(args: argparse.Namespace, engine_kwargs) -> int:
    from tokenforge.engine.llm import LLM  # noqa: PLC0415

    check_window(args.window, args.stride)            # before minutes of model loading
    text = _read_text(args.text_file)
    kwargs = eval_engine_kwargs(args, engine_kwargs)
    llm = LLM(**kwargs)
    result = perplexity(llm, text_token_ids(llm, text), args.window, args.stride)
    print(f"perplexity {result.perplexity:.4f} over {result.scored_tokens} tokens "
          f"({result.windows} windows of {result.window}, stride {result.stride}) in {result.seconds:.1f} s",
          file=sys.stderr, flush=True)
    record = {"perplexity": result.perplexity, "tokens": result.tokens, "window": result.window,
              "stride": result.stride, **{k: kwargs.get(k) for k in RECORDED_FLAGS},
              "nll": result.nll, "scored_tokens": result.scored_tokens, "windows": result.windows,
              "model": kwargs.get("model"), "device": llm.engine.executor.runner.device.type,
              "text_file": args.text_file, "seconds": result.seconds}
    if record["kv_cache_dtype"] == "fp8" and record["device"] == "cpu":
        record["simulated"] = True
    if args.compare_hf:
        record.update(_compare_hf(kwargs.get("model"), text_token_ids(llm, text), args, result.perplexity))
    _emit(record, args.json_out)
    return 0


def _compare_hf(model: str | None, token_ids: list[int], args: argparse.Namespace, ours: float) -> dict:
    from tokenforge.eval.hf_reference import hf_perplexity, load_hf_model  # noqa: PLC0415

    hf = hf_perplexity(load_hf_model(model), token_ids, sliding_windows(len(token_ids), args.window, args.stride))
    delta = 100.0 * (ours / hf - 1.0)
    print(f"HF transformers (float32) perplexity {hf:.4f}; tokenforge differs by {delta:+.3f}%",
          file=sys.stderr, flush=True)
    return {"hf_perplexity": hf, "hf_delta_pct": delta}


def run_quality(args: argparse.Namespace, engine_kwargs) -> int:
    check_window(args.window, args.stride)
    text = _read_text(args.text_file)
    base = {k: v for k, v in eval_engine_kwargs(args, engine_kwargs).items() if k not in RECORDED_FLAGS}
    rows = quality_table(text, base, args.window, args.stride)
    print(format_table(rows), file=sys.stderr, flush=True)
    _emit({"text_file": args.text_file, "window": args.window, "stride": args.stride,
           "model": base.get("model"), "rows": rows}, args.json_out)
    return 0
