"""Spawned by test_resume_layout: one rank of a CPU training run (gloo), or a sequence of runs.

Each run trains tiny-llama (random init, the synthetic tokenizer) and writes, per rank, the
train-sample ids it read at every step and the logged losses, so the test can check that a
resumed run on another number of ranks neither skips nor repeats a sample.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def run_rank(rank: int, world: int, port: int, runs: list[dict]) -> None:
    torch.set_num_threads(1)
    from tokenforge.engine.tokenization import load_engine_tokenizer
    from tokenforge.train import trainer as trainer_mod
    from tokenforge.train.config import TrainConfig

    class Recording(trainer_mod.PackedTokens):
        """The train split, noting which samples this rank reads (validation reads are not noted)."""

        log: list[int] | None = None

        def __init__(self, data_dir, split, **kw):
            super().__init__(data_dir, split, **kw)
            self.reads = Recording.log if split == "train" else None

        def sample(self, index, seq_len):
            if self.reads is not None:
                self.reads.append(index)
            return super().sample(index, seq_len)

    trainer_mod.PackedTokens = Recording
    tokenizer = load_engine_tokenizer("tiny-llama", "dummy")
    for i, run in enumerate(runs):
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port + i))
        if world == 1:
            os.environ.pop("WORLD_SIZE")
        Recording.log = reads = []
        steps: list[list[int]] = []
        per_step = run["cfg"]["global_batch_tokens"] // run["cfg"]["seq_len"] // world

        def on_step(step: int) -> None:
            steps.append(reads[len(steps) * per_step:])

        result = trainer_mod.train(TrainConfig(**run["cfg"]), tokenizer, on_step=on_step)
        out = Path(run["report"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{rank}.json").write_text(json.dumps({"losses": result.losses, "steps": steps}))
