"""Everything `tokenforge train` checks and builds before the first step.

In: a validated TrainConfig, the model's tokenizer (the CLI loads it). Out: `Checked` (data
facts, world size, accumulation) after checks that need no compute: the data exists, is complete
and was made by this model's tokenizer, the batch divides evenly, the run directory is writable,
and a previous run there is resumed only when asked. Then `build_model` loads the weights (a GGUF,
an HF directory, an earlier run's final export, or random init from a config) and applies LoRA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenforge.model.arch_config import ArchConfig
from tokenforge.model.loader import load_model, read_arch_config
from tokenforge.train.checkpoint import latest_checkpoint
from tokenforge.train.config import TrainConfig
from tokenforge.train.data import SPLITS, DataError, read_meta
from tokenforge.train.shards import check_shard, split_shards
from tokenforge.train.lora import attach_lora
from tokenforge.train.tokenize import tokenizer_fingerprint


@dataclass(frozen=True, slots=True)
class Checked:
    model_source: str | None        # what load_model gets (an earlier run's dir -> its final/)
    arch: ArchConfig
    meta: dict
    world_size: int
    accum: int
    global_seqs: int


def resolve_model(model: str | None) -> str | None:
    """An earlier run's directory stands for its final export."""
    if model and (Path(model) / "final" / "config.json").is_file():
        return str(Path(model) / "final")
    return model


def check_inputs(cfg: TrainConfig, tokenizer: Any) -> Checked:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    source = resolve_model(cfg.model)
    arch = read_arch_config(source, cfg.load_format)
    meta = read_meta(Path(cfg.data))
    _check_tokenizer(meta, tokenizer, arch)
    for split in SPLITS:       # every shard's size and checksum, before any model is built
        for shard in split_shards(Path(cfg.data), meta, split):
            check_shard(shard, checksum=cfg.verify_data)
    micro_tokens = cfg.micro_batch_size * cfg.seq_len
    global_tokens = cfg.global_batch_tokens or micro_tokens * world
    if global_tokens % (micro_tokens * world):
        raise ValueError(f"--global-batch-tokens {global_tokens} is not a multiple of --micro-batch-size x "
                         f"--seq-len x ranks = {cfg.micro_batch_size} x {cfg.seq_len} x {world} = "
                         f"{micro_tokens * world}")
    if meta["splits"]["train"]["tokens"] <= cfg.seq_len:
        raise DataError(f"the training split has {meta['splits']['train']['tokens']} tokens: fewer than one "
                        f"--seq-len {cfg.seq_len} window plus its label")
    _check_run_dir(Path(cfg.output), cfg.resume)
    accum = global_tokens // (micro_tokens * world)
    return Checked(source, arch, meta, world, accum, global_tokens // cfg.seq_len)


def _check_tokenizer(meta: dict, tokenizer: Any, arch: ArchConfig) -> None:
    mine = tokenizer_fingerprint(tokenizer)
    if meta["tokenizer"] != mine:
        raise DataError(f"the data was tokenized with another tokenizer (fingerprint {meta['tokenizer']}, "
                        f"this model's is {mine}); run `tokenforge preprocess --model` with this model")
    if meta["max_token_id"] >= arch.vocab_size:
        raise DataError(f"the data holds token id {meta['max_token_id']}, outside the model's vocabulary "
                        f"of {arch.vocab_size}")


def _check_run_dir(out: Path, resume: bool) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"the output directory {out} is not writable ({e.strerror or e})") from e
    if latest_checkpoint(out) is not None and not resume:
        raise ValueError(f"{out} already holds checkpoints of a run: pass --resume to continue it, "
                         "or choose another --output")


def build_model(cfg: TrainConfig, checked: Checked, device: torch.device,
                model: nn.Module | None = None) -> nn.Module:
    """fp32 master weights on `device`, in training mode; `model` (tests) skips the load."""
    if model is None:
        model = load_model(checked.model_source, cfg.load_format, torch.float32, device, seed=cfg.seed).model
    model = model.to(device=device, dtype=torch.float32).train()
    if cfg.lora_rank:
        attach_lora(model, cfg.lora_rank, cfg.lora_alpha)
    return model


def compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def resolve_strategy(cfg: TrainConfig, world: int) -> str:
    if cfg.strategy == "auto":
        return "ddp" if world > 1 else "none"
    if cfg.strategy == "none" and world > 1:
        raise ValueError("--strategy none runs one process; under torchrun use --strategy ddp or fsdp")
    return cfg.strategy
