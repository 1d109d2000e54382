"""Why one engine's batch-1 step takes 0.52 ms and the next one's 0.79 ms on the same GPU (round 26:
0.515-0.988 ms for the same none engine in one process). Builds --engines engines one after the
other in this process (dummy weights of --model, batch 1, greedy, --tokens tokens, ignore_eos) and
prints per engine: the median engine step, the process's CPU seconds per wall second over the
timed pass (threads spinning beside the step loop show as > 1), torch's intra-op threads, the
process's thread count, and which threads ran (R) at the end.

  python bench/step_modes.py --engines 4 [--threads 1] [--model smollm2-135m] [--tokens 256]
Out: one JSON line per engine on stdout (and a summary line).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def _threads() -> tuple[int, list[str]]:
    names = []
    tasks = list(Path("/proc/self/task").iterdir())
    for t in tasks:
        try:
            stat = (t / "stat").read_text()
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            state = stat[stat.rindex(")") + 2]
            if state == "R":
                names.append(comm)
        except OSError:
            continue
    return len(tasks), names


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before the first engine")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    import torch

    from tokenforge import LLM, SamplingParams
    if args.threads:
        torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    medians = []
    for i in range(args.engines):
        llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=8)
        llm.generate(["warm up"], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        engine, real, times = llm.engine, llm.engine.step, []

        def timed(real=real, times=times):
            t0 = time.perf_counter()
            out = real()
            times.append(time.perf_counter() - t0)
            return out
        engine.step = timed
        cpu0, wall0 = sum(os.times()[:2]), time.perf_counter()
        llm.generate(["The history of the city begins"], params, use_tqdm=False)
        cpu, wall = sum(os.times()[:2]) - cpu0, time.perf_counter() - wall0
        engine.step = real
        count, running = _threads()
        med = statistics.median(times) * 1e3
        medians.append(med)
        print(json.dumps({"engine": i, "median_step_ms": round(med, 4), "p90_step_ms": round(
            sorted(times)[int(0.9 * len(times))] * 1e3, 4), "steps": len(times), "cpu_per_wall": round(cpu / wall, 3),
            "torch_threads": torch.get_num_threads(), "process_threads": count, "running": running,
            "cpus": len(os.sched_getaffinity(0))}), flush=True)
        llm.shutdown()
        del llm
    print(json.dumps({"threads": args.threads, "medians_ms": [round(m, 3) for m in medians]}), flush=True)


if __name__ == "__main__":
    main()
