"""Where a synchronous speculative step's host time goes (lead probe, wave 3 round 12).

The H100 profile of W1 with the replay drafter (a = 0.8, K = 4) showed the device idle 16% of the
span, ~1.2 ms a verify step: host work between a verify's results landing and the next graph
launch. This wraps the pieces of that path with wall-clock timers and prints the mean per step.

Run: python bench/spec_host_timing.py [--model llama-3.1-8b] [--output-len 256] (GPU or CPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import defaultdict

TIMES: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)


def timed(obj, name: str, label: str) -> None:
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES[label] += time.perf_counter() - t
            COUNTS[label] += 1
    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch  # noqa: PLC0415

    from tokenforge import LLM, SamplingParams  # noqa: PLC0415
    from tokenforge.bench.lib import replay  # noqa: PLC0415

    llm = LLM(model=args.model, load_format="dummy", dtype=args.dtype, max_model_len=4096,
              speculative_method="ngram", num_speculative_tokens=4)
    vocab = llm.tokenizer.vocab_size if hasattr(llm.tokenizer, "vocab_size") else 512
    prompt = [(7 * i) % min(1000, vocab - 8) + 5 for i in range(args.input_len)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    drafts = llm.engine.scheduler.drafts
    drafts.adaptive = False
    base = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    drafts.proposer = replay.ReplayDrafter([prompt], [list(base)], 0.8, vocab, 0)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)        # learn the verify path's tokens
    drafts.adaptive = True
    drafts.reset_counters()

    core = llm.engine
    ex = core.executor
    runner = getattr(ex, "runner", None)
    timed(core, "step", "engine.step")
    timed(core, "_launch", "  _launch")
    timed(core, "_schedule", "    schedule")
    timed(ex, "launch", "    executor.launch")
    if runner is not None:
        timed(runner, "_forward", "      forward (graph replay)")
        timed(runner, "_after_forward", "      after_forward (LM head, verify ops)")
        if runner.graphs is not None and hasattr(runner.graphs, "buffers"):
            timed(runner.graphs.buffers, "fill", "        metadata fill")
        timed(runner, "collect", "    collect (wait + take)")
        timed(runner.role, "collect", "      role.collect")
    if torch.cuda.is_available():
        timed(torch.cuda.Event, "synchronize", "      wait (event synchronize)")
        timed(torch.cuda.Stream, "synchronize", "      wait (stream synchronize)")
    timed(core, "_finish", "  _finish")
    timed(ex, "collect", "    executor.collect")
    timed(core.scheduler, "update_from_output", "    update_from_output")
    import tokenforge.executor.model_runner as mr  # noqa: PLC0415
    orig = mr.build_inputs

    def build(*a, **k):
        t = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            TIMES["      build_inputs"] += time.perf_counter() - t
            COUNTS["      build_inputs"] += 1
    mr.build_inputs = build
    TIMES.clear(); COUNTS.clear()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    steps = COUNTS["engine.step"]
    stats = drafts.stats()
    rows = {k: {"ms_per_step": TIMES[k] / max(1, steps) * 1e3, "calls": COUNTS[k]} for k in TIMES}
    print(f"wall {wall * 1e3:.1f} ms, {len(out[0].outputs[0].token_ids)} tokens, {steps} engine steps, "
          f"{wall / max(1, steps) * 1e3:.3f} ms a step; acceptance length {stats.get('mean_acceptance_length')}")
    inside = TIMES["engine.step"] / max(1, steps) * 1e3
    waits = sum(TIMES[k] for k in TIMES if k.strip().startswith("wait")) / max(1, steps) * 1e3
    print(f"host outside engine.step (the LLM loop) {wall / max(1, steps) * 1e3 - inside:.3f} ms/step; "
          f"host inside it, waits excluded {inside - waits:.3f} ms/step")
    for k, v in rows.items():
        print(f"{k:44s} {v['ms_per_step']:8.3f} ms/step  ({v['calls']} calls)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"wall_ms": wall * 1e3, "steps": steps, "rows": rows, "spec": stats,
                       "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}, f, indent=1)


if __name__ == "__main__":
    main()
