"""What every tokenforge bench shares: engine flags, building and freeing an LLM, timed generate.

In: parsed CLI arguments. Out: an `LLM` built from them, `(outputs, seconds)` of a synchronized
`generate`, and correctness checks (forced lengths, deterministic greedy output) that run before
any figure is trusted.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import time
from dataclasses import dataclass, field

import torch

from tokenforge.bench.lib import workloads
from tokenforge.config import EngineConfig, ModelConfig


def add_common_args(p: argparse.ArgumentParser, *, model: str | None, dtype: str, num_prompts: int | None,
                    input_len: int | None, output_len: int | None, repeats: int) -> None:
    """The flags every engine bench shares, and the bench's defaults for the engine flags' model
    and dtype (the bench module sets ENGINE_FLAGS, so cli/bench.py added those flags already)."""
    g = p.add_argument_group("bench")
    g.add_argument("--out", default=None, help="also copy the results JSON (and plots) to this folder")
    g.add_argument("--results-dir", default=None, help="results folder (default: the current directory)")
    g.add_argument("--num-prompts", type=int, default=num_prompts)
    g.add_argument("--input-len", type=int, default=input_len)
    g.add_argument("--output-len", type=int, default=output_len)
    g.add_argument("--repeats", type=int, default=repeats, help="timed runs; the median is reported")
    g.add_argument("--no-baseline", action="store_true", help="skip HF transformers in this run")
    g.add_argument("--hf-variants", default=None,
                   help="HF generate variants to try, best reported (default: eager,static on GPU; eager on CPU)")
    g.add_argument("--quick-ceilings", action="store_true", help="tiny ceiling probes (smoke runs only)")
    # load_format None: dummy weights for a config without weights, the real loader otherwise.
    p.set_defaults(model=model, dtype=dtype, load_format=None)


def hf_variants(args: argparse.Namespace) -> list[str | None] | None:
    """'eager,static' -> [None, 'static'] (None = HF's default dynamic cache)."""
    if not getattr(args, "hf_variants", None):
        return None
    return [None if v.strip() == "eager" else v.strip() for v in args.hf_variants.split(",") if v.strip()]


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
    """`LLM(...)` keyword arguments: the CLI's converter (cli/engine_args.engine_kwargs, which `tokenforge
    bench` puts in the namespace), else the config's own reading of the namespace."""
    kwargs = getattr(args, "engine_kwargs_fn", EngineConfig.cli_kwargs)(args)
    kwargs["load_format"] = args.load_format or default_load_format(args.model)
    kwargs.update(overrides)
    return kwargs


def profile_run(llm, prompts: list[list[int]], args: argparse.Namespace) -> None:
    """With --profile-dir: one more (untimed) pass under torch.profiler; the trace goes there and
    the device-busy fraction to `args.profile` (near 100%: the loop is GPU-bound)."""
    if not getattr(args, "profile_dir", None):
        return
    params = sampling_params(args.output_len, cache_salt="profile")
    llm.start_profile()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    table = llm.stop_profile()
    summary = getattr(llm.engine.executor, "profile_summary", None) or {}
    args.profile = {**summary, "wall_s": wall, "profile_dir": args.profile_dir}
    print(table.split("\n\n")[0] if summary else table[:2000], flush=True)


# Engine flags that change the numerics or the bytes moved: recorded in every result, and a
# non-default one names the result file (W8-kv_cache_dtype-fp8.json beside W8.json).
QUALITY_FLAGS = ("quantization", "quantization_group_size", "kv_cache_dtype", "sparsity", "prune_rate")
_FLAG_DEFAULTS = {"kv_cache_dtype": "auto", "quantization_group_size": ModelConfig().quantization_group_size}


def quality_flags(kwargs: dict) -> dict:
    return {k: kwargs.get(k, _FLAG_DEFAULTS.get(k)) for k in QUALITY_FLAGS}


def variant_tag(args: argparse.Namespace) -> str:
    """'' for the default engine, else e.g. 'quantization-fp8-kv_cache_dtype-fp8' (for file names)."""
    kwargs = engine_kwargs(args)
    return "-".join(f"{k}-{v}" for k, v in quality_flags(kwargs).items()
                    if v is not None and v != _FLAG_DEFAULTS.get(k))


def build_llm(args: argparse.Namespace, **overrides):
    from tokenforge import LLM  # noqa: PLC0415 - the engine is heavy; import on use

    kwargs = engine_kwargs(args, **overrides)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    print(f"tokenforge: built LLM in {time.perf_counter() - t0:.1f} s with {kwargs}", flush=True)
    sched = llm.config.scheduler
    # What the engine resolved (device defaults included), recorded in the result JSON.
    args.resolved_engine = {"max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
                            "max_model_len": sched.max_model_len, "num_kv_blocks": llm.engine.num_kv_blocks,
                            "async_scheduling": llm.engine.async_scheduling, "pipeline_steps": sched.pipeline_steps,
                            "flags": quality_flags(kwargs)}
    print(f"tokenforge: engine {args.resolved_engine}", flush=True)
    return llm


def shutdown(llm) -> None:
    """Stop an engine's workers, if it has any. Its memory returns once the caller's last
    reference is gone: build and use an engine inside one function, then `release_memory()`."""
    for name in ("shutdown", "close"):
        fn = getattr(llm, name, None)
        if callable(fn):
            fn()
            return


def release_memory() -> None:
    gc.collect()    # engines hold reference cycles (core <-> runner); collect before emptying
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def vocab_size(llm, model: str | None) -> int:
    runtime = getattr(llm, "runtime", None)    # the engine's own answer, when it gives one
    if getattr(runtime, "vocab_size", None):
        return runtime.vocab_size
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
    prefix_hit_tokens: list[int] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)     # gaps between a request's tokens, all runs
    ttft_ms: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        return {"runs_s": self.seconds, "median_s": self.median, "spread": self.spread,
                "deterministic": self.deterministic, "prefix_hit_tokens": self.prefix_hit_tokens}

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def spread(self) -> float:
        return (max(self.seconds) - min(self.seconds)) / self.median if len(self.seconds) > 1 else 0.0


def run_checked(llm, prompts: list[list[int]], output_len: int, repeats: int, label: str) -> tuple[Timing, list]:
    """Check before timing, then time `repeats` runs of all prompts submitted at once.

    Every run gets its own `cache_salt`, so a run never reuses the prefix-cache blocks of an
    earlier run (that would flatter every run after the first); prompts within a run still share.
    The check runs a small subset twice: lengths must be the forced ones and greedy output must
    repeat. Timed runs are compared with each other too (same batch, so same kernels); a change
    there is flagged in `Timing.deterministic` rather than thrown away after minutes of work.
    """
    subset = prompts[: min(len(prompts), 8)]
    first, _ = timed_generate(llm, subset, sampling_params(output_len, cache_salt=f"{label}-check-0"))
    second, _ = timed_generate(llm, subset, sampling_params(output_len, cache_salt=f"{label}-check-1"))
    check_lengths(first, output_len, label)
    check_same(token_ids(first), token_ids(second), f"{label} warm-up")
    if torch.cuda.is_available():
        # One untimed pass of the whole workload: Triton compiles a kernel per new shape on first
        # use, and the subset above does not meet every shape (round 1 and 2 of W2 lost a third of
        # the first timed run to it; bench/NOTES.md).
        _, seconds = timed_generate(llm, prompts, sampling_params(output_len, cache_salt=f"{label}-warmup"))
        print(f"{label}: untimed warm-up pass: {seconds:.3f} s", flush=True)
    timing, reference = Timing(), None
    for r in range(max(1, repeats)):
        hits0 = prefix_hits(llm)
        params = sampling_params(output_len, cache_salt=f"{label}-run-{r}")
        outs, seconds = timed_generate(llm, prompts, params)
        check_lengths(outs, output_len, label)
        ids = token_ids(outs)
        if reference is None:
            reference = ids
        elif ids != reference:
            timing.deterministic = False
            print(f"WARNING {label}: greedy outputs of run {r} differ from run 0", flush=True)
        timing.seconds.append(seconds)
        timing.prefix_hit_tokens.append(prefix_hits(llm) - hits0)
        record_token_times(timing, outs)
        print(f"{label}: run {r}: {seconds:.3f} s", flush=True)
    return timing, outs


def record_token_times(timing: Timing, outs) -> None:
    """Per-token gaps from the engine's per-request `metrics["token_times"]` stamps, if present."""
    for o in outs:
        metrics = getattr(o, "metrics", None) or {}
        times = metrics.get("token_times") or []
        timing.itl_ms += [(b - a) * 1e3 for a, b in itertools.pairwise(times)]
        if metrics.get("first_token_time") and metrics.get("arrival_time"):
            timing.ttft_ms.append((metrics["first_token_time"] - metrics["arrival_time"]) * 1e3)


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 99)) -> dict[int, float | None]:
    if not values:
        return {q: None for q in qs}
    ordered = sorted(values)
    # nearest-rank: the smallest value with at least q% of the values at or below it
    return {q: ordered[max(0, min(len(ordered) - 1, -(-q * len(ordered) // 100) - 1))] for q in qs}


def prefix_hits(llm) -> int:
    stats = llm.get_stats() if hasattr(llm, "get_stats") else None
    return int(getattr(stats, "prefix_cache_hits", 0) or 0)


def rates(num_prompts: int, input_len: float, output_len: int, seconds: float) -> dict:
    out_tokens = num_prompts * output_len
    return {"output_tok_s": out_tokens / seconds,
            "total_tok_s": (out_tokens + num_prompts * input_len) / seconds,
            "seconds": seconds}


WEIGHT_FLAGS = ("quantization", "quantization_group_size", "quantize_lm_head", "prune_rate", "sparsity",
                "kv_cache_dtype")


def weight_options(args: argparse.Namespace) -> dict:
    """The quantization / pruning flags of this run (recorded in every result JSON)."""
    return {k: getattr(args, k) for k in WEIGHT_FLAGS if hasattr(args, k)}


def begin(workload: str, args: argparse.Namespace, bench: str, why: str) -> tuple[dict, dict]:
    """The start every GPU bench shares: a result record, the ceilings measured in this run, and
    the model's config.json (which `why` needs)."""
    from tokenforge.bench.lib import ceilings, report  # noqa: PLC0415 - they import this module

    result = report.new_result(workload, args.model, args.dtype)
    result["weights"] = weight_options(args)
    result["flags"] = quality_flags(engine_kwargs(args))
    result["variant"] = variant_tag(args)
    result["ceilings"] = ceilings.measure_ceilings(device(), args.quick_ceilings)
    print(f"ceilings: {ceilings.describe(result['ceilings'])}", flush=True)
    cfg = workloads.load_config_dict(args.model)
    if cfg is None:
        raise SystemExit(f"bench {bench} needs a model with a config.json ({why}), got {args.model!r}")
    return result, cfg
