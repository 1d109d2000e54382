"""Resume onto another layout: a checkpoint written by one number of ranks (DDP, FSDP2 or one
process) continues on another, on the CPU with gloo. No training sample is skipped or read twice
across the change (checked by sample ids), and the losses match an uninterrupted run at the new
layout. A checkpoint of another model or tokenizer is refused, naming it, before any step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.train.layout_worker import run_rank

STEPS, SAVE_AT = 4, 2
BASE = dict(model="tiny-llama", load_format="dummy", seq_len=16, micro_batch_size=1, global_batch_tokens=64,
            lr=1e-2, warmup_steps=1, max_steps=STEPS, save_every=SAVE_AT, keep_last=0, eval_samples=0,
            tensorboard=False, device="cpu")


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from tests.train.conftest import sentences
    from tokenforge.engine.tokenization import load_engine_tokenizer
    from tokenforge.train.preprocess import PreprocessOptions, run_preprocess

    root = tmp_path_factory.mktemp("layout")
    (root / "text.txt").write_text("\n\n".join(sentences(40, 12, 4)))
    run_preprocess(PreprocessOptions((str(root / "text.txt"),), str(root / "data"), seq_len=16, val_fraction=0.0,
                                     shard_size=1024), load_engine_tokenizer("tiny-llama", "dummy"), progress=False)
    return root / "data"


def _launch(world: int, runs: list[dict], port: int) -> None:
    # forkserver: the ranks start from a fresh server process that imported torch and tokenforge
    # once (not from this process and its threads), instead of each importing them again (~7 s).
    mp.get_context("forkserver").set_forkserver_preload(
        ["tests.train.layout_worker", "tokenforge.train.trainer", "torch._dynamo", "torch.distributed.fsdp"])
    mp.start_processes(run_rank, args=(world, port, runs), nprocs=world, join=True, start_method="forkserver")


def _report(path: Path, world: int) -> tuple[list[float], list[list[int]]]:
    """(losses, sample ids read at each step by all ranks together)."""
    ranks = [json.loads((path / f"rank{r}.json").read_text()) for r in range(world)]
    steps = [sorted(i for rank in ranks for i in rank["steps"][s]) for s in range(len(ranks[0]["steps"]))]
    return ranks[0]["losses"], steps


def _run(root: Path, name: str, strategy: str, **kw) -> dict:
    return {"cfg": {**BASE, "data": kw.pop("data"), "output": str(root / name), "strategy": strategy, **kw},
            "report": str(root / f"{name}-report")}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, tiny_data):
    """Uninterrupted runs at 1 (one process), 2 (FSDP2, and DDP) and 4 (DDP) ranks, each saving at
    step 2, and the resumes 2 -> 1, 1 -> 2 and 2 -> 4 (from FSDP2 and from DDP) of those checkpoints."""
    root = tmp_path_factory.mktemp("runs")
    d = {"data": str(tiny_data)}

    def resume_dir(src: str, dst: str) -> None:
        ckpt = f"step_{SAVE_AT:08d}"
        shutil.copytree(root / src / "checkpoints" / ckpt, root / dst / "checkpoints" / ckpt)

    _launch(2, [_run(root, "w2", "fsdp", **d)], 29610)
    resume_dir("w2", "w2to1")
    _launch(1, [_run(root, "w1", "none", **d), _run(root, "w2to1", "none", resume=True, **d)], 29620)
    resume_dir("w1", "w1to2")
    _launch(2, [_run(root, "w1to2", "fsdp", resume=True, **d), _run(root, "ddp2", "ddp", **d)], 29630)
    resume_dir("w2", "w2to4")
    resume_dir("ddp2", "ddp2to4")
    _launch(4, [_run(root, "w4", "ddp", **d), _run(root, "w2to4", "ddp", resume=True, **d),
                _run(root, "ddp2to4", "ddp", resume=True, **d)], 29640)
    return root


@pytest.mark.parametrize("before, after, world", [("w2", "w2to1", 1), ("w1", "w1to2", 2), ("w2", "w2to4", 4),
                                                  ("ddp2", "ddp2to4", 4)])
def test_resume_on_another_number_of_ranks(layouts, before, after, world):
    ref_losses, ref_steps = _report(layouts / f"w{world}-report", world)
    first_losses, first_steps = _report(layouts / f"{before}-report", int(before[-1]))
    losses, steps = _report(layouts / f"{after}-report", world)
    assert len(steps) == STEPS - SAVE_AT and len(losses) == STEPS - SAVE_AT
    seen = [i for s in first_steps[:SAVE_AT] + steps for i in s]
    assert len(seen) == len(set(seen)) == STEPS * 4             # nothing read twice (one epoch) ...
    assert first_steps[:SAVE_AT] + steps == ref_steps           # ... nor skipped: the uninterrupted order
    assert losses == pytest.approx(ref_losses[SAVE_AT:], abs=1e-5, rel=0)
    assert first_losses[:SAVE_AT] == pytest.approx(ref_losses[:SAVE_AT], abs=1e-5, rel=0)
    meta = json.loads((layouts / after / "checkpoints" / f"step_{STEPS:08d}" / "trainer.json").read_text())
    assert meta["world_size"] == world and meta["position"] == STEPS * 4


def test_a_checkpoint_of_another_model_or_tokenizer_is_refused(layouts, tiny_data, tmp_path):
    from tokenforge.engine.tokenization import load_engine_tokenizer
    from tokenforge.train.config import TrainConfig
    from tokenforge.train.trainer import train

    ckpt = f"step_{SAVE_AT:08d}"
    shutil.copytree(layouts / "w1" / "checkpoints" / ckpt, tmp_path / "r" / "checkpoints" / ckpt)
    tokenizer = load_engine_tokenizer("tiny-llama", "dummy")
    cfg = {**BASE, "data": str(tiny_data), "output": str(tmp_path / "r"), "resume": True}
    with pytest.raises(ValueError, match=rf"cannot resume from {tmp_path / 'r' / 'checkpoints' / ckpt}: it was "
                                         r"trained with another model \(architecture or LoRA rank\)"):
        train(TrainConfig(**{**cfg, "lora_rank": 2}), tokenizer)
    meta_file = tmp_path / "r" / "checkpoints" / ckpt / "trainer.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "tokenizer": "0" * 24}))
    with pytest.raises(ValueError, match=rf"cannot resume from \S+{ckpt}: it was trained with another tokenizer"):
        train(TrainConfig(**cfg), tokenizer)
