"""`tokenforge bench latency`: W1, batch-1 decode against the memory-bandwidth roofline.

In: a model (default the Llama-3.1-8B shape with dummy bf16 weights), 128 tokens in, 256 out;
`--batch-size N` (the engine's max_num_seqs) decodes N requests at once: a fixed decode batch of N,
tok/s counting all N.
The quantized linears' decode kernel per shape and row count goes into the JSON (`quant_kernels`).
Out: tok/s, ms/token p50/p99 (gaps between a request's tokens, from the engine's per-token time
stamps), the fraction of the roofline (read bandwidth / bytes read per token, measured in the
same run), and HF transformers at batch 1 (best of eager and static cache).
"""

from __future__ import annotations

import argparse

from tokenforge.bench.lib import ceilings, harness, hf_baseline, replay, report, workloads


ENGINE_FLAGS = True     # cli/bench.py adds the engine flags


def add_args(p: argparse.ArgumentParser) -> None:
    harness.add_common_args(p, model=workloads.DEFAULT_GPU_MODEL, dtype="bfloat16",
                            num_prompts=1, input_len=128, output_len=256, repeats=3)
    p.add_argument("--replay-acceptance", type=float, default=None, metavar="A",
                   help="with --speculative-method: replace its drafts by the greedy continuation of a run "
                        "without speculation, each draft token kept with probability A (the verify path's "
                        "cost at a chosen acceptance, for dummy weights; bench/lib/replay.py)")


# Bytes per linear weight of each --quantization mode (int4: 4 bits plus a 16-bit scale and zero
# per group); fp8-sim and the CPU's int8 read float weights.
def _quant_bytes_per_weight(quantization: str | None, group: int, dtype: str) -> float | None:
    return {"int8": 1.0, "fp8": 1.0, "int4": 0.5 + 4 / group}.get(quantization or "")


def roofline(shape: workloads.ModelShape, dtype: str, read_bw_tbps: float, input_len: int,
             output_len: int, weights: dict | None = None) -> dict:
    """The batch-1 decode ceiling: every weight once per token, plus the KV at the mean length.
    With a quantization mode the linears (and the lm_head with quantize_lm_head) read fewer bytes;
    of a mixture of experts' per-token weights the router stays in the model dtype and only fp8
    quantizes the (float) experts (model/quant/experts.py)."""
    context = input_len + output_len / 2
    per_token = shape.decode_bytes_per_token(dtype, context)
    weights = weights or {}
    bpw = _quant_bytes_per_weight(weights.get("quantization"), weights.get("quantization_group_size") or 128, dtype)
    if bpw is not None:
        b = workloads._DTYPE_BYTES[dtype]
        quantized = shape.layers * shape.layer_linear_params
        if shape.top_k:
            quantized -= shape.layers * shape.hidden * shape.num_experts          # the router
            if weights.get("quantization") != "fp8" or shape.expert_value_bytes is not None:
                quantized -= shape.layers * shape.expert_params_per_token        # left as loaded (or MXFP4)
        quantized += shape.vocab * shape.hidden if weights.get("quantize_lm_head") else 0
        per_token -= quantized * (b - bpw)
    return {"bytes_per_token": per_token, "mean_context_len": context,
            "roofline_tok_s": read_bw_tbps * 1e12 / per_token,
            "roofline_ms_per_token": per_token / (read_bw_tbps * 1e12) * 1e3}


def tokenforge_figures(timing: harness.Timing, num_prompts: int, input_len: int, output_len: int) -> dict:
    p = harness.percentiles(timing.itl_ms)
    ttft = harness.percentiles(timing.ttft_ms, (50,))
    mean_itl = sum(timing.itl_ms) / len(timing.itl_ms) if timing.itl_ms else None
    return {
        **harness.rates(num_prompts, input_len, output_len, timing.median),
        "ms_per_token_p50": p[50], "ms_per_token_p99": p[99], "ms_per_token_mean": mean_itl,
        "decode_tok_s": 1e3 / mean_itl * num_prompts if mean_itl else None,
        "ttft_ms_p50": ttft[50], **timing.summary(),
    }


def measure(args: argparse.Namespace, prompts: list[list[int]], proposer=None, **overrides) -> tuple[harness.Timing, list, dict | None]:
    """Timing, greedy outputs and (with speculation) the drafts' acceptance stats of one engine.
    With the replay drafter, one untimed pass (K drafts a step) first teaches it the engine's own greedy path."""
    llm = harness.build_llm(args, **overrides)
    drafts = llm.engine.scheduler.drafts
    if proposer is not None:
        drafts.proposer, drafts.adaptive = proposer, False      # K drafts every step while it learns
        burst = getattr(llm.engine.executor.runner, "burst", None)
        if hasattr(burst, "use_proposer"):                      # batch-1 bursts draft on the device
            from tokenforge.bench.lib.replay_device import DeviceReplay  # noqa: PLC0415

            burst.use_proposer(DeviceReplay(proposer, burst.k, burst.capacity, burst.device))
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     harness.sampling_params(args.output_len, cache_salt="replay-calibration"), use_tqdm=False)
        drafts.adaptive = True
        drafts.reset_counters()
    timing, outs = harness.run_checked(llm, prompts, args.output_len, args.repeats, "tokenforge")
    harness.profile_run(llm, prompts, args)
    from tokenforge.model.quant import kernel_plan  # noqa: PLC0415 - torch waits until the bench runs

    args.quant_kernels = kernel_plan.chosen()
    stats = {**drafts.stats(), "verify_cost": drafts.verify_cost()} if drafts is not None else None
    harness.shutdown(llm)
    return timing, harness.token_ids(outs), stats


def measure_speculative(args: argparse.Namespace, prompts: list[list[int]], vocab: int) -> dict:
    """Speculation and none, in the same run: the ratio, the acceptance, and greedy equality."""
    base_timing, base_ids, _ = measure(args, prompts, speculative_method=None, num_speculative_tokens=None,
                                       speculative_model=None, speculative_tree=False)
    harness.release_memory()
    proposer = None
    if args.replay_acceptance is not None:
        proposer = replay.ReplayDrafter(prompts, base_ids, args.replay_acceptance, vocab, args.seed)
    timing, ids, stats = measure(args, prompts, proposer)
    base = tokenforge_figures(base_timing, args.num_prompts, args.input_len, args.output_len)
    k = args.num_speculative_tokens or 4
    out = {"timing": timing, "no_speculation": base, "spec_decode": stats,
           "greedy_equal_to_no_speculation": ids == base_ids,
           "replay_acceptance": args.replay_acceptance, "num_speculative_tokens": k}
    if args.replay_acceptance is not None:
        out["expected_tokens_per_step"] = replay.ReplayDrafter.expected_tokens_per_step(args.replay_acceptance, k)
        out["replay_keep_rate"] = replay.keep_rate(stats)
        out["greedy_equal_to_replayed"] = ids == proposer.continuations(prompts)
    return out


def main(args: argparse.Namespace) -> dict:
    batch = getattr(args, "max_num_seqs", None)      # --batch-size (the engine flag's alias): a fixed batch
    if batch is not None:
        args.num_prompts = batch
    result, cfg = harness.begin("W1", args, "latency", "for the roofline")
    result["batch_size"] = args.num_prompts
    shape = workloads.ModelShape.from_config(cfg)
    prompts = workloads.random_prompts(args.num_prompts, args.input_len, shape.vocab, args.seed)
    result["workload_args"] = {"num_prompts": args.num_prompts, "input_len": args.input_len,
                               "output_len": args.output_len}

    # HF first and freed: tokenforge then sizes its KV cache from the whole free GPU.
    if not args.no_baseline:
        result["baseline"] = hf_baseline.baseline_from_config(
            cfg, args.dtype, prompts, args.output_len, batch_size=args.num_prompts, seed=args.seed,
            variants=harness.hf_variants(args))

    spec = None
    if getattr(args, "speculative_method", None):
        spec = measure_speculative(args, prompts, shape.vocab)
        timing = spec.pop("timing")
    elif args.replay_acceptance is not None:
        raise ValueError("--replay-acceptance replaces a speculative method's drafts: give --speculative-method too")
    else:
        timing, _, _ = measure(args, prompts)
    harness.release_memory()
    tf = tokenforge_figures(timing, args.num_prompts, args.input_len, args.output_len)
    if spec is not None:
        result["speculative"] = spec
        spec["speedup_vs_no_speculation"] = tf["output_tok_s"] / spec["no_speculation"]["output_tok_s"]
    if getattr(args, "profile", None):
        tf["profile"] = args.profile
    result["tokenforge"] = tf
    result["quant_kernels"] = getattr(args, "quant_kernels", {})
    result["roofline"] = roofline(shape, args.dtype, result["ceilings"]["read_bw_tbps"],
                                  args.input_len, args.output_len, result.get("weights"))
    result["roofline_frac"] = tf["output_tok_s"] / args.num_prompts / result["roofline"]["roofline_tok_s"]
    if tf["decode_tok_s"]:
        result["roofline_frac_decode"] = tf["decode_tok_s"] / args.num_prompts / result["roofline"]["roofline_tok_s"]
    if result.get("baseline", {}).get("output_tok_s"):
        result["speedup_vs_baseline"] = tf["output_tok_s"] / result["baseline"]["output_tok_s"]
    report.save(result, args)
    print_summary(result)
    return result


def print_summary(r: dict) -> None:
    tf, roof = r["tokenforge"], r["roofline"]
    rows = [["tokenforge", tf["output_tok_s"], tf["ms_per_token_p50"], tf["ms_per_token_p99"],
             f"{r['roofline_frac']:.1%}"]]
    if r.get("baseline", {}).get("output_tok_s"):
        b = r["baseline"]
        rows.append([b["name"], b["output_tok_s"], None, None,
                     f"{b['output_tok_s'] / roof['roofline_tok_s']:.1%}"])
    rows.append(["roofline", roof["roofline_tok_s"], roof["roofline_ms_per_token"], None, "100.0%"])
    report.print_table(
        f"W1 latency  {r['model']} {r['dtype']}  {r['device']}  ({ceilings.describe(r['ceilings'])})",
        ["variant", "tok/s", "ms/tok p50", "ms/tok p99", "of roofline"], rows)
    if "speedup_vs_baseline" in r:
        print(f"tokenforge / HF: {r['speedup_vs_baseline']:.2f}x")
    spec = r.get("speculative")
    if spec is not None:
        stats = spec["spec_decode"] or {}
        print(f"speculative / none: {spec['speedup_vs_no_speculation']:.2f}x "
              f"({spec['no_speculation']['output_tok_s']:.1f} tok/s without); acceptance "
              f"{stats.get('acceptance_rate', 0):.1%}, mean acceptance length {stats.get('mean_acceptance_length', 0):.2f}; "
              f"greedy equal: {spec['greedy_equal_to_no_speculation']}")
