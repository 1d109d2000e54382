"""`tokenforge bench spec-replay`: the n-gram proposer's accepted tokens per verify step on real
text, offline (bench/lib/ngram_replay.py), and the speed-up its acceptance buys under a cost model.

In: `--workload grounded,grounded-held-out,chat` (bench/lib/text_prompts.py), `--num-prompts` per
workload, `--output-len` (the max_tokens cap); the answers are generated greedy without
speculation (any device: greedy output does not depend on speculation), or read from `--ids`
(a JSON this bench wrote with `--save-ids`, {workload: [{prompt, output}]}), so rules can be
compared without a model. `--k 4,8,16` drafts a step; `--costs 4:1.25,16:1.8` the verify cost
c(K) in decode steps. Out: per workload, K and proposer, tokens per verify step, the share of
steps that drafted nothing and the modelled speed-up over no speculation for a burst (every
iteration costs c(K)) and for a host verify (an empty one costs a decode). Proposers: `burst`
(n down to 1 and resync, as the device bursts draft) and `host` (NgramProposer at the configured
ngram_min, as the engine's host steps draft), each beside `-latest`, the rule before
executor/spec/ngram.py's context tie-break and resync (the latest occurrence of the longest match).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenforge.bench.lib import harness, ngram_replay, report, text_prompts

ENGINE_FLAGS = True


def add_args(p: argparse.ArgumentParser) -> None:
    harness.add_common_args(p, model=None, dtype="auto", num_prompts=18, input_len=None, output_len=192, repeats=1)
    p.add_argument("--workload", default="grounded,grounded-held-out,chat",
                   help="comma list of: " + ", ".join(sorted(text_prompts.WORKLOADS)))
    p.add_argument("--k", default="4,8,16", help="comma list of draft counts K")
    p.add_argument("--costs", default=",".join(f"{k}:{c}" for k, c in ngram_replay.MEASURED_COSTS.items()),
                   help="K:c pairs, a verify of K drafts in decode steps (default: the measured ones)")
    p.add_argument("--ids", default=None, help="read the answers from this JSON instead of generating them")
    p.add_argument("--save-ids", default=None, help="write the generated answers to this JSON")


def _answers(args: argparse.Namespace, names: list[str]) -> dict[str, list[ngram_replay.Continuation]]:
    if args.ids:
        saved = json.loads(Path(args.ids).read_text())
        return {w: [ngram_replay.Continuation(r["prompt"], r["output"]) for r in saved[w]] for w in names}
    from tokenforge import SamplingParams  # noqa: PLC0415

    llm = harness.build_llm(args, speculative_method=None, num_speculative_tokens=None, speculative_model=None)
    try:
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0)
        out = {}
        for w in names:
            prompts = text_prompts.WORKLOADS[w](args.num_prompts)
            done = [llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0] for p in prompts]
            out[w] = [ngram_replay.Continuation(list(d.prompt_token_ids), list(d.outputs[0].token_ids)) for d in done]
    finally:
        harness.shutdown(llm)
    if args.save_ids:
        Path(args.save_ids).write_text(json.dumps({w: [{"prompt": c.prompt, "output": c.output} for c in cs]
                                                   for w, cs in out.items()}))
    return out


def _proposers(args: argparse.Namespace) -> dict:
    from tokenforge.executor.spec.ngram import NgramProposer  # noqa: PLC0415

    lo, hi = getattr(args, "ngram_min", None) or 2, getattr(args, "ngram_max", None) or 4
    return {"burst-latest": ngram_replay.latest_match(1, hi), "burst": NgramProposer(1, hi, resync=True).propose_one,
            "host-latest": ngram_replay.latest_match(lo, hi), "host": NgramProposer(lo, hi).propose_one}


def main(args: argparse.Namespace) -> dict:
    names = [w.strip() for w in args.workload.split(",") if w.strip()]
    bad = [w for w in names if w not in text_prompts.WORKLOADS]
    if bad or not names:
        raise SystemExit(f"--workload: unknown {bad}; choose from {', '.join(sorted(text_prompts.WORKLOADS))}")
    ks = [int(k) for k in args.k.split(",")]
    costs = {int(k): float(c) for k, c in (pair.split(":") for pair in args.costs.split(","))}
    answers, proposers = _answers(args, names), _proposers(args)
    result = report.new_result("spec-replay", args.model, args.dtype)
    result["workload_args"] = {"workloads": names, "num_prompts": args.num_prompts, "max_tokens": args.output_len,
                               "k": ks, "costs": costs, "ids": args.ids}
    rows, table = [], []
    for w in names:
        for k in ks:
            cost = ngram_replay.verify_cost(k, costs)
            for name, propose in proposers.items():
                st = ngram_replay.replay(answers[w], propose, k)
                row = {"workload": w, "k": k, "proposer": name, "verify_cost": cost, "steps": st.steps,
                       "tokens_per_step": st.tokens_per_step, "empty_share": st.empty / max(1, st.steps),
                       "speedup_burst": st.speedup(cost, burst=True), "speedup_host": st.speedup(cost, burst=False)}
                rows.append(row)
                table.append([w, k, name, row["tokens_per_step"], row["empty_share"], row["speedup_burst"],
                              row["speedup_host"]])
    result["rows"] = rows
    report.save(result, args)
    report.print_table(f"n-gram replay (modelled)  {result['model']}", ["workload", "K", "proposer", "tokens/step",
                       "empty", "x none (burst)", "x none (host)"], table)
    return result
