"""`tokenforge bench lora`: multi-LoRA throughput against the bare model, in one run.

In: a model (default the Llama-3.1-8B shape, dummy bf16 weights), a workload (W2: 1000 x 256/256,
or W1), and N random rank-r adapters on all seven projections, generated for the model's shape
(`--num-adapters`, `--lora-rank`; kept under --lora-dir or a temp folder). The bare engine runs
first and is freed; then an engine with --enable-lora (`--max-loras`, default min(N, 16)) runs the
same prompts with the adapters assigned uniformly at random (seeded). Out: both throughputs, their
ratio (the issue's targets: >= 85% for W2 over 8 adapters, >= 90% for W1 with one, >= 75% with
64 adapters through 16 slots), the slot writes (swaps) per run, and with --profile-dir the LoRA
kernels' share of device time (a batch-1 decode shrinks inside the base GEMV,
`_gemv_shrink_kernel`, reported apart since its time is mostly the base weights', then expands
in `_expand_row_kernel`, counted with the LoRA kernels).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import tempfile
import time
from pathlib import Path

from tokenforge import envs
from tokenforge.bench.lib import harness, report, workloads

ENGINE_FLAGS = True
_LORA_KERNELS = ("_shrink_kernel", "_expand_kernel", "_expand_row_kernel")    # name prefixes
_FUSED_GEMV = "_gemv_shrink_kernel"


def add_args(p: argparse.ArgumentParser) -> None:
    harness.add_common_args(p, model=workloads.DEFAULT_GPU_MODEL, dtype="bfloat16", num_prompts=None,
                            input_len=None, output_len=None, repeats=2)
    p.add_argument("--workload", choices=("W1", "W2"), default="W2")
    p.add_argument("--num-adapters", type=int, default=8, help="random adapters to generate and spread requests over")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-dir", default=None, help="where the generated adapters go (default: a temp folder)")
    p.add_argument("--side-stream-ab", action="store_true",
                   help="also time the LoRA engine with the shrink on a side stream (TOKENFORGE_LORA_SIDE_STREAM=1) "
                        "in the same run, against the same bare model (the same as --extra-run side)")
    p.add_argument("--extra-run", action="append", default=[], metavar="SPEC",
                   help="also time a LoRA engine built with SPEC, a comma list of `side` (the shrink on a side "
                        "stream), `gemm` / `kernel` (the shrink in the base product / as its own kernel on every "
                        "linear) and kernel tile settings (TOKENFORGE_LORA_TILES' NAME=N), e.g. "
                        "`side,expand_prologue=1`; repeatable, each against the same bare model")
    p.set_defaults(max_loras=None)       # the engine flag's bench default: min(--num-adapters, 16)


def write_adapters(cfg: dict, args: argparse.Namespace, root: Path) -> list[str]:
    import torch  # noqa: PLC0415

    from tokenforge.model.arch_config import ArchConfig  # noqa: PLC0415
    from tokenforge.model.loader.peft import write_random_adapter  # noqa: PLC0415

    arch = ArchConfig.from_hf_config(cfg)
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    return [str(write_random_adapter(arch, root / f"adapter-{i}", args.lora_rank, seed=i, std=0.02, dtype=dtype))
            for i in range(args.num_adapters)]


def timed_lora_runs(llm, prompts: list[list[int]], loras: list, args: argparse.Namespace) -> tuple[harness.Timing, list]:
    """Check lengths on a subset, then `repeats` timed runs (a fresh cache salt each) and the swaps of each."""
    inputs = [{"prompt_token_ids": p} for p in prompts]
    check = llm.generate(inputs[:8], harness.sampling_params(args.output_len, cache_salt="lora-check"),
                         use_tqdm=False, lora_request=loras[:8])
    harness.check_lengths(check, args.output_len, "tokenforge lora")
    llm.generate(inputs, harness.sampling_params(args.output_len, cache_salt="lora-warmup"), use_tqdm=False,
                 lora_request=loras)
    timing, swaps = harness.Timing(), []
    for r in range(max(1, args.repeats)):
        before = llm.get_stats().lora_swaps
        harness.sync()
        t0 = time.perf_counter()
        outs = llm.generate(inputs, harness.sampling_params(args.output_len, cache_salt=f"lora-run-{r}"),
                            use_tqdm=False, lora_request=loras)
        harness.sync()
        timing.seconds.append(time.perf_counter() - t0)
        harness.check_lengths(outs, args.output_len, "tokenforge lora")
        swaps.append(llm.get_stats().lora_swaps - before)
        print(f"lora: run {r}: {timing.seconds[-1]:.3f} s, {swaps[-1]} slot writes", flush=True)
    return timing, swaps


def timeline_advance(kernels: list[tuple[float, float, str]]) -> dict[str, float]:
    """Per kernel name, the device time it alone adds: how far each kernel's end passes the ends of
    every kernel started before it ((start, end, name) in us). Kernels launched early under PDL
    wait inside their span for the one before; this counts only what they add to the timeline."""
    advanced: dict[str, float] = {}
    far = -float("inf")
    for start, end, name in sorted(kernels):
        if end > far:
            advanced[name] = advanced.get(name, 0.0) + end - max(start, far)
            far = end
    return advanced


def kernel_share(llm, prompts: list[list[int]], loras: list, args: argparse.Namespace) -> dict | None:
    """One profiled (untimed) run: the LoRA kernels' share of the device's kernel time."""
    if not getattr(args, "profile_dir", None):
        return None
    import torch  # noqa: PLC0415

    inputs = [{"prompt_token_ids": p} for p in prompts]
    from tokenforge.executor.executor import device_busy  # noqa: PLC0415

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(inputs, harness.sampling_params(args.output_len, cache_salt="lora-profile"), use_tqdm=False,
                     lora_request=loras)
        wall = time.perf_counter() - t0
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = [(name, end - start) for start, end, name in kernels]
    advanced = timeline_advance(kernels)
    total = sum(us for _, us in spans) or 1.0
    out = Path(args.profile_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.txt").write_text(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30))
    lora = sum(us for name, us in spans if name.startswith(_LORA_KERNELS))
    timeline = sum(advanced.values()) or 1.0
    lora_alone = sum(us for name, us in advanced.items() if name.startswith(_LORA_KERNELS))
    return {"lora_kernels_us": lora, "device_us": total, "lora_share": lora / total, "wall_s": wall,
            "lora_timeline_us": lora_alone, "timeline_us": timeline, "lora_timeline_share": lora_alone / timeline,
            "device_busy": device_busy(prof.events()),
            "lora_launches": sum(1 for name, _ in spans if name.startswith(_LORA_KERNELS)),
            "fused_gemv_us": sum(us for name, us in spans if name.startswith(_FUSED_GEMV)),
            "fused_gemv_launches": sum(1 for name, _ in spans if name.startswith(_FUSED_GEMV))}


# spec item -> (the variable it sets, its value): `side` the shrink on a side stream, `gemm` the
# shrink in the base product on every linear, `kernel` the shrink kernel on every linear
SWITCHES = {"side": (envs.LORA_SIDE_STREAM, "1"), "gemm": (envs.LORA_SHRINK_IN_GEMM, "1"),
            "kernel": (envs.LORA_SHRINK_IN_GEMM, "0")}


def extra_specs(args: argparse.Namespace) -> list[tuple[str, tuple[str, ...], str]]:
    """(spec, switches, tile settings) of each extra LoRA run asked for (SWITCHES' items; what a
    spec does not name keeps the default run's setting); a tile setting TOKENFORGE_LORA_TILES
    would refuse is a ValueError before any engine is built."""
    out = []
    for spec in (["side"] if args.side_stream_ab else []) + list(args.extra_run):
        items = [i for i in spec.replace(" ", "").split(",") if i]
        tiles = ",".join(i for i in items if i not in SWITCHES)
        with envs.override(envs.LORA_TILES, tiles):
            envs.lora_tiles()
        out.append((spec, tuple(i for i in items if i in SWITCHES), tiles))
    return out


def extra_run(args: argparse.Namespace, prompts, loras, max_loras: int, switches: tuple[str, ...], tiles: str):
    """(timing, swaps, linears computing the shrink in their product) of the same LoRA runs on an
    engine built with the switches and tiles given (the slots read TOKENFORGE_LORA_SIDE_STREAM,
    _SHRINK_IN_GEMM and _TILES when built)."""
    harness.release_memory()
    with contextlib.ExitStack() as stack:
        for item in switches:
            stack.enter_context(envs.override(*SWITCHES[item]))
        stack.enter_context(envs.override(envs.LORA_TILES, tiles))
        llm = harness.build_llm(args, enable_lora=True, max_loras=max_loras, max_lora_rank=max(args.lora_rank, 16),
                                max_cpu_loras=max(args.num_adapters, max_loras))
    try:
        return (*timed_lora_runs(llm, prompts, loras, args), shrink_in_gemm_linears(llm))
    finally:
        harness.shutdown(llm)


def shrink_in_gemm_linears(llm) -> int | None:
    """How many of the engine's LoRA linears compute the shrink in their base product (None where
    the slots live in another process)."""
    runner = getattr(getattr(llm.engine, "executor", None), "runner", None)
    loras = getattr(runner, "loras", None)
    if loras is None:
        return None
    return sum(1 for linear in loras.slots.linears.values() if linear.lora.in_gemm is not None)


def main(args: argparse.Namespace) -> dict:
    n, i, o = workloads.WORKLOADS[args.workload]
    args.num_prompts, args.input_len, args.output_len = args.num_prompts or n, args.input_len or i, args.output_len or o
    specs = extra_specs(args)
    result, cfg = harness.begin(f"{args.workload}-lora", args, "lora", "for the adapters' shapes")
    prompts = workloads.random_prompts(args.num_prompts, args.input_len, cfg["vocab_size"], args.seed)
    bare = harness.build_llm(args, enable_lora=False, lora_modules=(), max_loras=1)
    bare_timing, _ = harness.run_checked(bare, prompts, args.output_len, args.repeats, "bare")
    harness.shutdown(bare)
    del bare
    harness.release_memory()
    root = Path(args.lora_dir) if args.lora_dir else Path(tempfile.mkdtemp(prefix="tokenforge-lora-bench-"))
    paths = write_adapters(cfg, args, root)
    from tokenforge import LoRARequest  # noqa: PLC0415

    adapters = [LoRARequest(f"adapter-{k}", k + 1, p) for k, p in enumerate(paths)]
    rng = random.Random(args.seed)
    loras = [rng.choice(adapters) for _ in prompts]
    max_loras = args.max_loras or min(args.num_adapters, 16)
    llm = harness.build_llm(args, enable_lora=True, max_loras=max_loras, max_lora_rank=max(args.lora_rank, 16),
                            max_cpu_loras=max(args.num_adapters, max_loras))
    timing, swaps = timed_lora_runs(llm, prompts, loras, args)
    share = kernel_share(llm, prompts, loras, args)
    in_gemm = shrink_in_gemm_linears(llm)
    harness.shutdown(llm)
    del llm
    extras = [(spec, extra_run(args, prompts, loras, max_loras, switches, tiles)) for spec, switches, tiles in specs]
    rates = {"bare": harness.rates(args.num_prompts, args.input_len, args.output_len, bare_timing.median),
             "lora": harness.rates(args.num_prompts, args.input_len, args.output_len, timing.median)}
    result.update({"adapters": {"num": args.num_adapters, "rank": args.lora_rank, "max_loras": max_loras,
                                "targets": "q,k,v,o,gate,up,down", "kernel_tiles": envs.lora_tiles(),
                                "side_stream": envs.lora_side_stream(), "shrink_in_gemm_linears": in_gemm},
                   "bare": {**rates["bare"], **bare_timing.summary()}, "tokenforge": {**rates["lora"], **timing.summary()},
                   "swaps_per_run": swaps, "lora_kernels": share,
                   "lora_vs_bare": rates["lora"]["output_tok_s"] / rates["bare"]["output_tok_s"]})
    result["lora"] = result["tokenforge"]
    rows = [["bare", rates["bare"]["output_tok_s"], rates["bare"]["total_tok_s"], None],
            [f"{args.num_adapters} adapters r{args.lora_rank}, {max_loras} slots",
             rates["lora"]["output_tok_s"], rates["lora"]["total_tok_s"], f"{result['lora_vs_bare']:.1%}"]]
    result["extra_runs"] = []
    for spec, (extra_timing, extra_swaps, extra_in_gemm) in extras:
        extra_rates = harness.rates(args.num_prompts, args.input_len, args.output_len, extra_timing.median)
        entry = {"spec": spec, **extra_rates, **extra_timing.summary(), "swaps_per_run": extra_swaps,
                 "shrink_in_gemm_linears": extra_in_gemm,
                 "vs_bare": extra_rates["output_tok_s"] / rates["bare"]["output_tok_s"]}
        result["extra_runs"].append(entry)
        if spec == "side":
            result["lora_side_stream"] = entry
        rows.append([f"  LoRA with {spec}", extra_rates["output_tok_s"], extra_rates["total_tok_s"],
                     f"{entry['vs_bare']:.1%}"])
    report.save(result, args)
    report.print_table(f"{args.workload} multi-LoRA  {result['model']} {result['dtype']}  {result['device']}",
                       ["variant", "output tok/s", "total tok/s", "of bare"], rows)
    if share:
        print(f"LoRA kernels: {share['lora_share']:.1%} of kernel time (a PDL wait inside a span counts), "
              f"{share['lora_timeline_share']:.1%} of the device timeline they alone extend", flush=True)
    return result
