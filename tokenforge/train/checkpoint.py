"""Resumable checkpoints through torch.distributed.checkpoint (DCP), and the gathered weights.

In: the (wrapped) model, optimizer, scheduler and the trainer's position. Out: RUN/checkpoints/
step_XXXXXXXX/, holding DCP shards of model and optimizer state (each rank writes its own shards
under FSDP2), trainer.json (step, data position, scheduler) and one RNG file per rank.

Writes are atomic: every rank writes into a hidden temporary directory, and after a barrier rank
0 renames it to its final name, so a directory named step_* is always complete. Only the newest
`keep_last` are kept.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from tokenforge.train.parallel import Dist

logger = logging.getLogger(__name__)
PREFIX = "step_"


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, trainer_state: dict, d: Dist,
                    keep_last: int) -> Path:
    step = trainer_state["step"]
    final = checkpoint_root(run_dir) / f"{PREFIX}{step:08d}"
    tmp = checkpoint_root(run_dir) / f".tmp-{PREFIX}{step:08d}"
    if d.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    d.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng_rank{d.rank}.pt")
    d.barrier()
    if d.is_main:
        meta = {**trainer_state, "scheduler": scheduler.state_dict(), "world_size": d.world_size}
        (tmp / "trainer.json").write_text(json.dumps(meta, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _prune(run_dir, keep_last)
    d.barrier()
    logger.info("saved %s", final)
    return final


def _prune(run_dir: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, d: Dist) -> dict:
    """Restore everything in place; returns trainer.json (step, position, ...)."""
    meta = json.loads((path / "trainer.json").read_text())
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(meta["scheduler"])
    rng = path / f"rng_rank{d.rank}.pt"
    if rng.is_file() and meta.get("world_size") == d.world_size:
        _set_rng_state(torch.load(rng, weights_only=False))
    return meta


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer, gathered to full tensors on the CPU (rank 0 gets
    them under FSDP2; other ranks get an empty dict)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)
