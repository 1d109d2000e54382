"""`tokenforge train`: the training loop.

In: a TrainConfig and the model's tokenizer. Out: RUN/metrics.jsonl, RUN/tensorboard/,
RUN/checkpoints/step_*/ (resumable), RUN/final/ (HF layout) when max_steps is reached.

Each step takes the next global batch (data.SampleOrder), runs it through TrainStep and, on the
steps the flags name, logs, evaluates and saves. SIGINT and SIGTERM set a flag that the loop
reads between steps: it saves a resumable checkpoint and returns normally (exit status 0).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import resource
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenforge.train.checkpoint import full_state_dict, latest_checkpoint, load_checkpoint, save_checkpoint
from tokenforge.train.config import TrainConfig
from tokenforge.train.data import PackedTokens, SampleOrder, eval_micro_batches, step_micro_batches
from tokenforge.train.export import export_hf
from tokenforge.train.metrics import (
    MetricsLogger,
    attention_flops_per_token,
    dense_flops_per_token,
    measured_peak_tflops,
)
from tokenforge.train.optim import build_optimizer, build_scheduler
from tokenforge.train.parallel import Dist, destroy_distributed, init_distributed, prepare_layers, wrap_model
from tokenforge.train.setup import Checked, build_model, check_inputs, compute_dtype, resolve_strategy
from tokenforge.train.step import TrainStep

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RunState:
    step: int = 0
    position: int = 0               # training samples consumed (global)
    stop_requested: bool = False
    losses: list[float] = field(default_factory=list)


@dataclass(slots=True)
class TrainResult:
    steps: int
    losses: list[float]             # mean loss of each step run in this process
    final_dir: Path | None
    checkpoint: Path | None
    interrupted: bool


class Trainer:
    def __init__(self, cfg: TrainConfig, tokenizer: Any, checked: Checked, d: Dist,
                 model: nn.Module | None = None) -> None:
        self.cfg, self.tokenizer, self.checked, self.d = cfg, tokenizer, checked, d
        self.run_dir = Path(cfg.output)
        self.strategy = resolve_strategy(cfg, d.world_size)
        self.dtype = compute_dtype(cfg, d.device)
        torch.manual_seed(cfg.seed)
        self.model = build_model(cfg, checked, d.device, model)
        prepare_layers(self.model, cfg.activation_checkpointing,
                       d.device.type == "cuda" if cfg.compile is None else cfg.compile)
        self.wrapped = wrap_model(self.model, self.strategy, d, self.dtype)
        self.optimizer = build_optimizer(self.wrapped, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2), d.device)
        self.scheduler = build_scheduler(self.optimizer, cfg.warmup_steps, cfg.max_steps, cfg.scheduler,
                                         cfg.min_lr_ratio)
        self.step_fn = TrainStep(self.wrapped, self.strategy, self.optimizer, self.scheduler, d, self.dtype,
                                 cfg.grad_clip)
        data_dir = Path(cfg.data)
        # setup.check_inputs verified every shard's checksum already.
        self.train_data = PackedTokens(data_dir, "train", verify=False, meta=checked.meta)
        val_tokens = checked.meta["splits"].get("val", {}).get("tokens", 0)
        self.val_data = PackedTokens(data_dir, "val", verify=False, meta=checked.meta) if val_tokens > cfg.seq_len else None
        self.order = SampleOrder(self.train_data.num_samples(cfg.seq_len), cfg.seed)
        self.metrics = MetricsLogger(self.run_dir, d.is_main, cfg.tensorboard)
        self.peak_tflops = measured_peak_tflops(d.device)
        self.state = RunState()

    # ---- the loop ----

    def fit(self, on_step: Callable[[int], None] | None = None) -> TrainResult:
        self._maybe_resume()
        last_saved = None
        with _signals_to(self.state), self._profiler() as prof:
            tic, tokens_since = time.perf_counter(), 0
            while self.state.step < self.cfg.max_steps:
                result = self._one_step()
                tokens_since += self.checked.global_seqs * self.cfg.seq_len
                if prof is not None:
                    prof.step()
                if self.state.step % self.cfg.log_every == 0 or self.state.step == self.cfg.max_steps:
                    self._log(result, tokens_since / (time.perf_counter() - tic))
                    tic, tokens_since = time.perf_counter(), 0
                if self.cfg.eval_every and self.state.step % self.cfg.eval_every == 0:
                    self._evaluate()
                if on_step is not None:
                    on_step(self.state.step)
                stop = self.d.broadcast_flag(self.state.stop_requested)
                if stop or (self.cfg.save_every and self.state.step % self.cfg.save_every == 0):
                    last_saved = self._save()
                if stop:
                    logger.warning("interrupted: saved %s at step %d", last_saved, self.state.step)
                    return self._result(None, last_saved, interrupted=True)
        if self.val_data is not None and (not self.cfg.eval_every or self.state.step % self.cfg.eval_every):
            self._evaluate()
        if last_saved is None or not last_saved.name.endswith(f"{self.state.step:08d}"):
            last_saved = self._save()
        return self._result(self._export(), last_saved, interrupted=False)

    def _one_step(self):
        batches = step_micro_batches(self.train_data, self.order, self.state.position, self.cfg.seq_len,
                                     self.cfg.micro_batch_size, self.checked.accum, self.d.rank,
                                     self.d.world_size, self.d.device)
        result = self.step_fn.run(batches)
        self.state.step += 1
        self.state.position += self.checked.global_seqs
        return result

    def _log(self, result, tokens_per_s: float) -> None:
        loss = result.mean_loss()
        self.state.losses.append(loss)
        arch = self.checked.arch
        flops = dense_flops_per_token(arch)
        peak = self.peak_tflops
        record = {"step": self.state.step, "loss": loss, "lr": result.lr,
                  "grad_norm": float(result.grad_norm), "tokens_per_s": tokens_per_s,
                  "mfu": tokens_per_s * flops / (peak * 1e12 * self.d.world_size) if peak else None,
                  "attention_flops_per_token": attention_flops_per_token(arch, self.cfg.seq_len),
                  "dense_flops_per_token": flops, "memory_gib": _memory_gib(self.d.device),
                  "tokens_seen": self.state.position * self.cfg.seq_len}
        self.metrics.log(record)
        if self.d.is_main:
            logger.info("step %d loss %.4f lr %.3g %.0f tok/s", self.state.step, loss, record["lr"], tokens_per_s)

    def _evaluate(self) -> float | None:
        if self.val_data is None:
            return None
        self.wrapped.eval()
        batches = eval_micro_batches(self.val_data, self.cfg.seq_len, self.cfg.micro_batch_size,
                                     self.cfg.eval_samples, self.d.rank, self.d.world_size, self.d.device)
        loss_sum, tokens = self.step_fn.eval_loss(batches)
        self.wrapped.train()
        val = (loss_sum / tokens.clamp(min=1)).item()
        self.metrics.log({"step": self.state.step, "val_loss": val, "val_tokens": int(tokens.item())})
        return val

    # ---- state ----

    def _trainer_state(self) -> dict:
        return {"step": self.state.step, "position": self.state.position, "seed": self.cfg.seed,
                "global_batch_seqs": self.checked.global_seqs, "seq_len": self.cfg.seq_len,
                "num_train_samples": self.order.num_samples, **self.checked.identity}

    def _save(self) -> Path:
        return save_checkpoint(self.run_dir, self.wrapped, self.optimizer, self.scheduler, self._trainer_state(),
                               self.d, self.cfg.keep_last)

    def _maybe_resume(self) -> None:
        path = latest_checkpoint(self.run_dir) if self.cfg.resume else None
        if path is None:
            if self.cfg.resume:
                logger.warning("--resume: no checkpoint in %s, starting from step 0", self.run_dir)
            return
        meta = load_checkpoint(path, self.wrapped, self.optimizer, self.scheduler, self.d)
        if meta["seq_len"] != self.cfg.seq_len:
            raise ValueError(f"the checkpoint was trained with --seq-len {meta['seq_len']}, not {self.cfg.seq_len}")
        if meta.get("num_train_samples", self.order.num_samples) != self.order.num_samples:
            raise ValueError(f"cannot resume from {path}: it was trained on {meta['num_train_samples']} samples "
                             f"of --data, which now holds {self.order.num_samples} (other data?)")
        self.state.step, self.state.position = meta["step"], meta["position"]
        logger.warning("resumed from %s (step %d)", path, self.state.step)

    def _export(self) -> Path | None:
        state = full_state_dict(self.wrapped)
        if not self.d.is_main:
            self.d.barrier()
            return None
        export_dtype = self.dtype if self.cfg.export_dtype == "auto" else getattr(torch, self.cfg.export_dtype)
        out = export_hf(state, self.checked.arch, self.tokenizer, self.run_dir / "final", export_dtype,
                        self.cfg.lora_export, {"rank": self.cfg.lora_rank})
        self.d.barrier()
        return out

    def _result(self, final: Path | None, checkpoint: Path | None, interrupted: bool) -> TrainResult:
        self.metrics.close()
        return TrainResult(self.state.step, list(self.state.losses), final, checkpoint, interrupted)

    def _profiler(self):
        if not self.cfg.profile_dir:
            return contextlib.nullcontext()
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler  # noqa: PLC0415

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.d.device.type == "cuda" else [])
        return profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
                       on_trace_ready=tensorboard_trace_handler(self.cfg.profile_dir, worker_name=f"rank{self.d.rank}"))


@contextlib.contextmanager
def _signals_to(state: RunState):
    """SIGINT/SIGTERM request a save-and-stop at the next step boundary (main thread only)."""
    def request(signum, frame):
        logger.warning("signal %d: saving a checkpoint after this step", signum)
        state.stop_requested = True

    try:
        previous = {s: signal.signal(s, request) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:          # not the main thread: leave the handlers alone
        yield
        return
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20     # kB -> GiB


def train(cfg: TrainConfig, tokenizer: Any, model: nn.Module | None = None,
          on_step: Callable[[int], None] | None = None) -> TrainResult:
    """Check everything, then train. `model` (tests) is used instead of loading cfg.model."""
    cfg = cfg.validated()
    checked = check_inputs(cfg, tokenizer)
    d = init_distributed(cfg.device)
    trainer = None
    try:
        trainer = Trainer(cfg, tokenizer, checked, d, model)
        result = trainer.fit(on_step)
        d.barrier()             # no rank tears its group down while a peer is still in a collective
        return result
    finally:
        # DDP's reducer holds the process group: a trainer left to the cycle collector (or to the
        # interpreter's exit) destroys gloo's worker threads during finalization, which aborts the
        # process ("terminate called without an active exception") after the run succeeded.
        del trainer
        gc.collect()
        destroy_distributed()
