"""What every tokenforge bench shares: engine flags, building and freeing an LLM, timed generate.

In: parsed CLI arguments. Out: an `LLM` built from them, `(outputs, seconds)` of a synchronized
`generate`, and correctness checks (forced lengths, deterministic greedy output) that run before
any figure is trusted.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import dataclass, field

import torch

from tokenforge.bench import workloads

# Engine keyword arguments the benches pass through, when given on the command line.
ENGINE_ARGS = ("load_format", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "kv_cache_memory",
               "gpu_memory_utilization", "enforce_eager", "attention_backend", "max_model_len", "block_size")


def add_common_args(p: argparse.ArgumentParser, *, model: str | None, dtype: str, num_prompts: int,
                    input_len: int, output_len: int, repeats: int) -> None:
    p.add_argument("--out", default=None, help="also copy the results JSON (and plots) to this folder")
    p.add_argument("--results-dir", default=None, help="results folder (default bench/results)")
    p.add_argument("--model", default=model, help=f"model name, HF dir or config.json (default {model or 'bundled'})")
    p.add_argument("--load-format", default=None, help="auto | dummy (default: dummy for a config, auto otherwise)")
    p.add_argument("--dtype", default=dtype, help=f"compute dtype (default {dtype})")
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--input-len", type=int, default=input_len)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--repeats", type=int, default=repeats, help="timed runs; the median is reported")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and the dummy weights")
    p.add_argument("--no-baseline", action="store_true", help="skip HF transformers in this run")
    p.add_argument("--quick-ceilings", action="store_true", help="tiny ceiling probes (smoke runs only)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory", default=None, help="absolute KV budget, e.g. 60GiB")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--attention-backend", default=None, help="auto | triton | torch")
    p.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def default_load_format(model: str | None) -> str:
    return "dummy" if workloads.find_config_json(model) is not None and not _has_weights(model) else "auto"


def _has_weights(model: str | None) -> bool:
    from pathlib import Path  # noqa: PLC0415

    p = Path(model) if model else None
    return bool(p and p.is_dir() and (any(p.glob("*.safetensors")) or any(p.glob("*.gguf"))))


def engine_kwargs(args: argparse.Namespace, **overrides) -> dict:
    kwargs = {"model": args.model, "dtype": args.dtype, "seed": args.seed,
              "load_format": args.load_format or default_load_format(args.model)}
    for name in ENGINE_ARGS:
        value = getattr(args, name, None)
        if value is not None:
            kwargs[name] = value
    kwargs.update(overrides)
    return kwargs


def build_llm(args: argparse.Namespace, **overrides):
    from tokenforge import LLM  # noqa: PLC0415 - the engine is heavy; import on use

    kwargs = engine_kwargs(args, **overrides)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    print(f"tokenforge: built LLM in {time.perf_counter() - t0:.1f} s with {kwargs}", flush=True)
    return llm


def free_llm(llm) -> None:
    """Release an engine's device memory so the next one (or HF) can have it."""
    for name in ("shutdown", "close"):
        fn = getattr(llm, name, None)
        if callable(fn):
            fn()
            break
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def vocab_size(llm, model: str | None) -> int:
    cfg = workloads.load_config_dict(model)
    if cfg is not None:
        return cfg["vocab_size"]
    tok = getattr(llm, "tokenizer", None)
    if tok is not None:
        return len(tok)
    raise ValueError(f"cannot tell the vocabulary size of {model!r}")


def sampling_params(output_len: int, **extra):
    from tokenforge import SamplingParams  # noqa: PLC0415

    return SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0, **extra)


def timed_generate(llm, prompts: list[list[int]], params) -> tuple[list, float]:
    """All prompts submitted at once; seconds from submission to the last token."""
    inputs = [{"prompt_token_ids": p} for p in prompts]
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    sync()
    return outs, time.perf_counter() - t0


def token_ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def check_lengths(outs, expected: int, what: str = "tokenforge") -> None:
    lengths = {len(o.outputs[0].token_ids) for o in outs}
    if lengths != {expected}:
        raise AssertionError(f"{what}: output lengths {sorted(lengths)} differ from the forced {expected}")


def check_same(a: list[list[int]], b: list[list[int]], what: str) -> None:
    diff = sum(x != y for x, y in zip(a, b, strict=True))
    if diff:
        raise AssertionError(f"{what}: {diff} of {len(a)} greedy outputs changed between two runs")


@dataclass(slots=True)
class Timing:
    """Repeated timings of one variant; the median is the figure, the spread says what is noise."""

    seconds: list[float] = field(default_factory=list)
    deterministic: bool = True

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def spread(self) -> float:
        return (max(self.seconds) - min(self.seconds)) / self.median if len(self.seconds) > 1 else 0.0


def run_checked(llm, prompts: list[list[int]], output_len: int, repeats: int, label: str) -> tuple[Timing, list]:
    """Check before timing, then time `repeats` runs of all prompts at once.

    The check runs a small subset twice: lengths must be the forced ones and greedy output must
    repeat. Timed runs are compared with each other too (same batch, so same kernels); a change
    there is reported in `Timing.deterministic` rather than thrown away after minutes of work.
    """
    params = sampling_params(output_len)
    subset = prompts[: min(len(prompts), 8)]
    first, _ = timed_generate(llm, subset, params)
    second, _ = timed_generate(llm, subset, params)
    check_lengths(first, output_len, label)
    check_same(token_ids(first), token_ids(second), f"{label} warm-up")
    timing, reference = Timing(), None
    for r in range(max(1, repeats)):
        outs, seconds = timed_generate(llm, prompts, params)
        check_lengths(outs, output_len, label)
        ids = token_ids(outs)
        if reference is None:
            reference = ids
        elif ids != reference:
            timing.deterministic = False
            print(f"WARNING {label}: greedy outputs of run {r} differ from run 0", flush=True)
        timing.seconds.append(seconds)
        print(f"{label}: run {r}: {seconds:.3f} s", flush=True)
    return timing, outs


def rates(num_prompts: int, input_len: float, output_len: int, seconds: float) -> dict:
    out_tokens = num_prompts * output_len
    return {"output_tok_s": out_tokens / seconds,
            "total_tok_s": (out_tokens + num_prompts * input_len) / seconds,
            "seconds": seconds}
