"""`tokenforge bench frontend`: what the API server costs, offline `LLM` against HTTP streaming.

    tokenforge bench frontend --model llama-3.1-8b --load-format dummy --max-model-len 4096 \
        --serve-flags "--model llama-3.1-8b --load-format dummy --max-model-len 4096" --rates 4,8,16

Back to back on one machine: (1) the offline LLM generates `--num-prompts` forced-length
requests submitted at once (after a short untimed warm-up) and is shut down; (2) `tokenforge
serve --serve-flags` starts, and the same shape is streamed through HTTP at rate inf (fresh
prompts, every prefill shape warmed first); the ratio server / offline output tok/s is the
frontend's efficiency. (3) On the same server, W4 runs at each of `--rates` with
`--w4-num-prompts` requests and reports failures: every one must be 0.
"""

from __future__ import annotations

import argparse
import signal
import sys

from tokenforge.bench.lib import ceilings, harness, report, workloads
from tokenforge.bench.serving import serve


ENGINE_FLAGS = True     # cli/bench.py adds the engine flags


def add_args(p: argparse.ArgumentParser) -> None:
    harness.add_common_args(p, model=workloads.DEFAULT_GPU_MODEL, dtype="bfloat16",
                            num_prompts=300, input_len=1024, output_len=1024, repeats=1)
    p.add_argument("--serve-flags", required=True, help="flags of the `tokenforge serve` to compare (the same engine)")
    p.add_argument("--rates", default="4,8,16", help="W4 request rates to run on the server after the ratio ('' for none)")
    p.add_argument("--w4-num-prompts", type=int, default=300, help="requests per W4 rate")
    p.add_argument("--w4-output-len", type=int, default=None, help="W4 output length (default --output-len)")


def offline(args: argparse.Namespace) -> dict:
    """Output tok/s of the offline LLM; the engine is gone (memory released) when this returns."""
    llm = harness.build_llm(args)
    try:
        vocab = harness.vocab_size(llm, args.model)
        warm = workloads.random_prompts(16, args.input_len, vocab, seed=args.seed + 7, low_id=100)
        llm.generate([{"prompt_token_ids": p} for p in warm], harness.sampling_params(16), use_tqdm=False)
        prompts = workloads.random_prompts(args.num_prompts, args.input_len, vocab, seed=args.seed, low_id=100)
        outs, seconds = harness.timed_generate(llm, prompts, harness.sampling_params(args.output_len))
        harness.check_lengths(outs, args.output_len, "offline")
        return {"vocab_size": vocab, **harness.rates(args.num_prompts, args.input_len, args.output_len, seconds)}
    finally:
        harness.shutdown(llm)
        del llm
        harness.release_memory()


def server_runs(args: argparse.Namespace, vocab: int, result: dict) -> None:
    """Rate inf with the offline shape, then W4 at each rate, on one launched server; the result
    is saved after each run, so a run cut short by a time limit still reports what it measured."""
    ids = (min(100, vocab // 4), min(30000, vocab))
    with serve._launched(args.serve_flags, None) as url:
        model = serve.served_model(url)
        shape = serve.Load(num_prompts=args.num_prompts, rate=float("inf"), input_len=args.input_len,
                           output_len=args.output_len, seed=args.seed + 1000, id_range=ids)
        at_inf = serve.run(serve.run_load(url, model, shape))
        print(f"server at rate inf: {at_inf['output_tok_per_s']:,.0f} output tok/s, {at_inf['failed']} failed",
              flush=True)
        result["server_inf"] = at_inf
        result["server_over_offline"] = at_inf["output_tok_per_s"] / result["offline"]["output_tok_s"]
        w4 = result["w4"] = []
        _save(result, args)
        for i, rate in enumerate(float(r) for r in args.rates.split(",") if r.strip()):
            load = serve.Load(num_prompts=args.w4_num_prompts, rate=rate, input_len=args.input_len,
                              output_len=args.w4_output_len or args.output_len, seed=args.seed + 2000 + i, id_range=ids)
            w4.append(serve.run(serve.run_load(url, model, load, warm_up=False)))
            print(f"W4 {rate:g} req/s: {w4[-1]['completed']} ok, {w4[-1]['failed']} failed "
                  f"{w4[-1]['errors']}", flush=True)
            _save(result, args)


def _save(result: dict, args: argparse.Namespace) -> None:
    result["w4_failed"] = sum(r["failed"] for r in result.get("w4", [])) + result.get("server_inf", {}).get("failed", 0)
    report.save(result, args)


def main(args: argparse.Namespace) -> dict:
    # A time limit's SIGTERM must still run the launcher's cleanup (stop the server it started).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = report.new_result("frontend", args.model, args.dtype)
    result["ceilings"] = ceilings.measure_ceilings(harness.device(), args.quick_ceilings)
    result["offline"] = offline(args)
    print(f"offline: {result['offline']['output_tok_s']:,.0f} output tok/s", flush=True)
    _save(result, args)
    server_runs(args, result["offline"]["vocab_size"], result)
    _print(result)
    return result


def _print(result: dict) -> None:
    rows = [["offline LLM", result["offline"]["output_tok_s"], "", "", ""],
            ["server, rate inf", result["server_inf"]["output_tok_per_s"], result["server_inf"]["ttft_ms"]["p99"],
             result["server_inf"]["tpot_ms"]["p50"], result["server_inf"]["failed"]]]
    rows += [[f"W4 {r['request_rate']:g} req/s", r["output_tok_per_s"], r["ttft_ms"]["p99"], r["tpot_ms"]["p50"],
              r["failed"]] for r in result["w4"]]
    report.print_table(f"frontend: server / offline = {result['server_over_offline']:.1%}",
                       ["run", "output tok/s", "TTFT p99 ms", "TPOT p50 ms", "failed"], rows)
