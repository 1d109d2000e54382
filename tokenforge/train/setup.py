"""Everything `tokenforge train` checks and builds before the first step.

In: a validated TrainConfig, the model's tokenizer (the CLI loads it). Out: `Checked` (data
facts, world size, accumulation) after checks that need no compute: the data exists, is complete
and was made by this model's tokenizer, the batch divides evenly, the run directory is writable,
and a previous run there is resumed only when asked. Then `build_model` loads the weights (a GGUF,
an HF directory, an earlier run's final export, or random init from a config) and applies LoRA.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenforge import envs
from tokenforge.model.arch_config import ArchConfig
from tokenforge.model.loader import load_model, read_arch_config
from tokenforge.train.checkpoint import latest_checkpoint
from tokenforge.train.config import TrainConfig
from tokenforge.train.data import SPLITS, DataError, read_meta
from tokenforge.train.shards import check_shard, split_shards
from tokenforge.train.lora import attach_lora
from tokenforge.train.tokenize import tokenizer_fingerprint

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Checked:
    model_source: str | None        # what load_model gets (an earlier run's dir -> its final/)
    arch: ArchConfig
    meta: dict
    identity: dict                  # model and tokenizer fingerprints, kept in every checkpoint
    world_size: int
    accum: int
    global_seqs: int


def resolve_model(model: str | None) -> str | None:
    """An earlier run's directory stands for its final export."""
    if model and (Path(model) / "final" / "config.json").is_file():
        return str(Path(model) / "final")
    return model


def check_inputs(cfg: TrainConfig, tokenizer: Any) -> Checked:
    world = envs.world_size()
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
    identity = {"model_fingerprint": model_fingerprint(arch, cfg.lora_rank), "tokenizer": meta["tokenizer"]}
    if cfg.resume:
        _check_resumable(Path(cfg.output), identity, global_tokens // cfg.seq_len, world, cfg.seq_len)
    return Checked(source, arch, meta, identity, world, accum, global_tokens // cfg.seq_len)


def model_fingerprint(arch: ArchConfig, lora_rank: int) -> str:
    """A hash of the architecture (shapes, vocabulary, rope...) and the LoRA rank: what the
    checkpoint's tensors must match."""
    blob = json.dumps([asdict(arch), lora_rank], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _check_resumable(run_dir: Path, identity: dict, global_seqs: int, world: int, seq_len: int) -> None:
    """The newest checkpoint was written for this model and tokenizer (any number of ranks)."""
    path = latest_checkpoint(run_dir)
    if path is None:
        return
    meta_file = path / "trainer.json"
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot resume from {path}: {meta_file} is unreadable ({e})") from e
    for key, what in (("model_fingerprint", "another model (architecture or LoRA rank)"),
                      ("tokenizer", "another tokenizer")):
        if key in meta and meta[key] != identity[key]:
            raise ValueError(f"cannot resume from {path}: it was trained with {what} "
                             f"({key} {meta[key]}, this run's is {identity[key]})")
    if meta.get("seq_len", seq_len) != seq_len:
        raise ValueError(f"cannot resume from {path}: it was trained with --seq-len {meta['seq_len']}, not {seq_len}")
    if meta.get("global_batch_seqs", global_seqs) != global_seqs:
        logger.warning("%s was trained with a global batch of %d sequences, this run uses %d: the data "
                       "position carries over, the loss curve will not match", path, meta["global_batch_seqs"],
                       global_seqs)
    if meta.get("world_size", world) != world:
        logger.warning("resuming %s (%d ranks) on %d ranks: the state is resharded", path,
                       meta["world_size"], world)


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
