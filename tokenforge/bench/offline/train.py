"""`tokenforge bench train`: W11 training throughput, MFU and peak memory (random init, random tokens).

In: an architecture (default the shipped llama-3.2-1b config), the strategy (one process, or DDP /
FSDP2 under torchrun), sequence length, micro batch, global batch, activation checkpointing.
Out: tokens/s (all ranks), tokens/s per GPU, MFU against the matmul rate measured in the same run
(dense 6N FLOPs; `mfu_with_attention` adds causal attention), peak memory, step-time spread; a
results JSON written by rank 0.

Correctness first: the first step's loss must be finite and near ln(V) (random init on random
tokens), and the loss must not rise over the run.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from tokenforge.bench.lib import report
from tokenforge.bench.lib.ceilings import cpu_matmul_tflops, gpu_matmul_tflops
from tokenforge.model.loader import load_model
from tokenforge.train.metrics import attention_flops_per_token, dense_flops_per_token
from tokenforge.train.optim import build_optimizer, build_scheduler
from tokenforge.train.parallel import destroy_distributed, init_distributed, prepare_layers, wrap_model
from tokenforge.train.step import TrainStep


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3.2-1b", help="shipped config name or config.json (random init)")
    p.add_argument("--strategy", "--sharding_strategy", "--sharding-strategy", default="fsdp",
                   choices=["none", "ddp", "fsdp"])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--global-batch-tokens", type=int, default=None,
                   help="default: 4 micro batches per GPU (W11 proper is 524288)")
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--activation-checkpointing", "--use-checkpointing", action="store_true")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--tag", default=None, help="suffix of the workload name in the results file")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--out", default=None)
    p.add_argument("--results-dir", default=None)


def _batches(n: int, b: int, s: int, vocab: int, device: torch.device, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
        out.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(args: argparse.Namespace) -> dict | None:
    d = init_distributed(args.device)
    peak = gpu_matmul_tflops() if d.device.type == "cuda" else cpu_matmul_tflops(512)
    compute_dtype = getattr(torch, args.dtype) if d.device.type == "cuda" else torch.float32
    loaded = load_model(args.model, "dummy", torch.float32, d.device, seed=0)
    model, cfg = loaded.model.train(), loaded.arch_config
    micro_tokens = args.micro_batch_size * args.seq_len
    global_tokens = args.global_batch_tokens or 4 * micro_tokens * d.world_size
    if global_tokens % (micro_tokens * d.world_size):
        raise ValueError(f"--global-batch-tokens {global_tokens} is not a multiple of micro batch tokens "
                         f"({micro_tokens}) x world size ({d.world_size})")
    accum = global_tokens // (micro_tokens * d.world_size)
    prepare_layers(model, args.activation_checkpointing, args.compile and d.device.type == "cuda")
    wrapped = wrap_model(model, args.strategy, d, compute_dtype)
    optimizer = build_optimizer(wrapped, 3e-4, 0.1, (0.9, 0.95), d.device)
    scheduler = build_scheduler(optimizer, 0, 1 << 30, "constant", 0.0)
    step = TrainStep(wrapped, args.strategy, optimizer, scheduler, d, compute_dtype, 1.0)
    batches = _batches(accum, args.micro_batch_size, args.seq_len, cfg.vocab_size, d.device, seed=d.rank)
    losses, times = [], []
    if d.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(d.device)
    for i in range(args.warmup_steps + args.steps):
        _sync(d.device)
        t0 = time.perf_counter()
        result = step.run(batches)
        _sync(d.device)
        times.append(time.perf_counter() - t0)
        losses.append(result.mean_loss())
    timed = times[args.warmup_steps:]
    tokens_per_s = global_tokens / statistics.median(timed)
    dense, attn = dense_flops_per_token(cfg), attention_flops_per_token(cfg, args.seq_len)
    peak_total = peak * 1e12 * d.world_size
    out = {
        "strategy": args.strategy, "world_size": d.world_size, "seq_len": args.seq_len,
        "micro_batch_size": args.micro_batch_size, "global_batch_tokens": global_tokens,
        "grad_accum": accum, "activation_checkpointing": args.activation_checkpointing, "compile": args.compile,
        "tokens_per_s": tokens_per_s, "tokens_per_s_per_gpu": tokens_per_s / d.world_size,
        "mfu": tokens_per_s * dense / peak_total, "mfu_with_attention": tokens_per_s * (dense + attn) / peak_total,
        "dense_flops_per_token": dense, "attention_flops_per_token": attn,
        "step_s_median": statistics.median(timed), "step_s_min": min(timed), "step_s_max": max(timed),
        "compile_and_first_step_s": times[0], "losses": losses,
        "peak_memory_gib": (torch.cuda.max_memory_allocated(d.device) / 2**30 if d.device.type == "cuda" else None),
    }
    ok = math.isfinite(losses[0]) and abs(losses[0] - math.log(cfg.vocab_size)) < 1.5 and losses[-1] <= losses[0]
    out["correct"] = ok
    destroy_distributed()
    if not d.is_main:
        return None
    return _save(args, d, out, peak)


def _save(args: argparse.Namespace, d, out: dict, peak: float) -> dict:
    tag = args.tag or f"{args.strategy}-{d.world_size}gpu{'-ac' if args.activation_checkpointing else ''}"
    result = report.new_result(f"W11-{tag}", model=args.model, dtype=args.dtype)
    result["ceilings"] = {"matmul_tflops": peak}
    result["figures"] = out
    rows = [[k, out[k] if not isinstance(out[k], float) else round(out[k], 4)]
            for k in ("tokens_per_s", "tokens_per_s_per_gpu", "mfu", "mfu_with_attention", "peak_memory_gib",
                      "step_s_median", "compile_and_first_step_s", "correct")]
    report.print_table(f"W11 train {tag} (matmul peak {peak:.0f} TFLOP/s)", ["metric", "value"], rows)
    report.save(result, args)
    if not out["correct"]:
        print(f"CHECK FAILED: losses {out['losses']}")
    return result
