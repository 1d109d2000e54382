"""`tokenforge bench structured`: the throughput cost of grammar-constrained requests.

In: one engine and one batch of random prompts, run twice per repeat: all requests free, then half
of them constrained by a JSON schema (the grammar is applied every step: strings of unbounded
length keep random-weight models inside it). Output lengths are forced (ignore_eos), so both runs
produce the same number of tokens. Out: output tok/s of each and the overhead of the mixed batch
(mask computation, upload and application; with async scheduling the masks are filled while the
next step's forward runs, so on a GPU mostly the device-side masking remains).
Defaults: the bundled SmolLM2 on the CPU; on a GPU pass `--model llama-3.1-8b` (dummy weights).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tokenforge.bench.lib import harness, report

SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
          "required": ["notes"]}


ENGINE_FLAGS = True     # cli/bench.py adds the engine flags


def add_args(p: argparse.ArgumentParser) -> None:
    harness.add_common_args(p, model=None, dtype="auto", num_prompts=32, input_len=64,
                            output_len=64, repeats=3)
    p.set_defaults(no_baseline=True)


def _params(output_len: int, constrained: bool, salt: str):
    from tokenforge import SamplingParams, StructuredOutputsParams  # noqa: PLC0415

    spec = StructuredOutputsParams(json=SCHEMA) if constrained else None
    return SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0, cache_salt=salt,
                          structured_outputs=spec)


def _run(llm, prompts: list[list[int]], output_len: int, half: bool, tag: str) -> float:
    params = [_params(output_len, half and i % 2 == 1, tag) for i in range(len(prompts))]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    harness.sync()
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    harness.sync()
    seconds = time.perf_counter() - t0
    harness.check_lengths(outs, output_len, tag)
    return seconds


def main(args: argparse.Namespace) -> dict:
    result = report.new_result("structured", args.model, args.dtype)
    llm = harness.build_llm(args)
    vocab = harness.vocab_size(llm, args.model)
    rng = random.Random(args.seed if getattr(args, "seed", None) is not None else 0)
    prompts = [[rng.randrange(256, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    # Untimed passes of both variants: grammar compile, tokenizer build, every kernel shape.
    _run(llm, prompts, args.output_len, False, "warmup-free")
    _run(llm, prompts, args.output_len, True, "warmup-half")
    free, half = [], []
    for r in range(max(1, args.repeats)):               # interleaved, so drift hits both alike
        free.append(_run(llm, prompts, args.output_len, False, f"free-{r}"))
        half.append(_run(llm, prompts, args.output_len, True, f"half-{r}"))
        print(f"run {r}: free {free[-1]:.3f} s, half constrained {half[-1]:.3f} s", flush=True)
    harness.shutdown(llm)
    tokens = args.num_prompts * args.output_len
    f, h = statistics.median(free), statistics.median(half)
    result["workload_args"] = {"num_prompts": args.num_prompts, "input_len": args.input_len,
                               "output_len": args.output_len, "schema": SCHEMA}
    result["tokenforge"] = {"output_tok_s": tokens / h, "runs_s": half, "name": "half constrained"}
    result["baseline"] = {"output_tok_s": tokens / f, "runs_s": free, "name": "all free (same engine)"}
    result["overhead"] = h / f - 1.0
    report.save(result, args)
    report.print_table(f"structured outputs  {result['model']}  {result['device']}",
                       ["batch", "output tok/s", "median s"],
                       [["all free", tokens / f, f], ["half constrained", tokens / h, h]])
    print(f"constrained overhead: {result['overhead']:+.1%} (target <= 10%)")
    return result
