"""The CPU's native decode step (kernels/gguf_decode.cpp) timed on the bundled SmolLM2 at two
contexts: 1 row (a batch-1 decode), 5 rows of one sequence (a K = 4 verify) and 5 rows of other
sequences, ms a step (the mean of `--reps` after one untimed step).

Run: python bench/cpu_native_attention.py (CPU). For an A/B, run it on two commits in turn, more
than once each: a shared 2-core host moves single runs by 10-20%.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[300, 1000])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    from tokenforge import LLM  # noqa: PLC0415 - the engine is heavy; import on use
    from tokenforge.model.attention.backend import AttentionBatch  # noqa: PLC0415

    llm = LLM(max_model_len=4096)
    runner = llm.engine.executor.runner
    decoder, bs = runner.graphs.decoder, runner.block_size

    def ms_a_step(contexts: list[int], tables: list[list[int]]) -> float:
        ids = torch.zeros(len(contexts), dtype=torch.long)
        batch = AttentionBatch([1] * len(contexts), contexts, tables, bs, torch.device("cpu"))
        decoder.forward(ids, batch)
        start = time.perf_counter()
        for _ in range(args.reps):
            decoder.forward(ids, batch)
        return (time.perf_counter() - start) / args.reps * 1e3

    for ctx in args.contexts:
        blocks = (ctx + 40) // bs + 2
        a, b = list(range(1, blocks + 1)), list(range(blocks + 1, 2 * blocks + 1))
        one = ms_a_step([ctx], [a])
        verify = ms_a_step([ctx + j for j in range(5)], [a] * 5)
        others = ms_a_step([ctx + 7 * j for j in range(5)], [a, b, a, b, a])
        print(f"ctx {ctx}: 1 row {one:.2f} ms, 5 rows of one sequence {verify:.2f} ms, "
              f"5 rows of other sequences {others:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
