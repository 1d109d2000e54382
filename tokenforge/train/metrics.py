"""Training logs: FLOPs per token and MFU, metrics.jsonl, TensorBoard event files.

In: per-step figures from the trainer (rank 0 only). Out: `RUN/metrics.jsonl` (one JSON object a
logged step: step, loss, lr, grad_norm, tokens_per_s, mfu, memory; validation lines carry
val_loss) and TensorBoard scalars under `RUN/tensorboard/`.

MFU = tokens/s x dense FLOPs per token / the bf16 matmul rate measured at start-up, with dense
FLOPs = 6 x (non-embedding parameters + the LM head) as BENCHMARKING.md defines it. Attention
FLOPs (causal, 6 L S d_q per token) are logged beside it; the bench reports `mfu_with_attention`.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from tokenforge.model.arch_config import ArchConfig

logger = logging.getLogger(__name__)



def dense_flops_per_token(cfg: ArchConfig) -> float:
    """6 x (non-embedding parameters + LM head): forward 2, backward 4 FLOPs per weight."""
    params = cfg.num_parameters()    # a tied embedding/head counts once: that once is the head's matmul
    return 6.0 * (params if cfg.tie_word_embeddings else params - cfg.vocab_size * cfg.hidden_size)


def attention_flops_per_token(cfg: ArchConfig, seq_len: int) -> float:
    """Causal attention scores and values, forward + backward: 6 x layers x S x d_q."""
    return 6.0 * cfg.num_hidden_layers * seq_len * cfg.q_size


def measured_peak_tflops(device: torch.device, n: int = 8192, repeats: int = 10) -> float | None:
    """The device's bf16 matmul rate, measured once at start-up (BENCHMARKING.md: MFU is against
    the measured rate, not the datasheet). None on the CPU, where MFU is not reported."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * repeats / (start.elapsed_time(end) * 1e-3) / 1e12


class MetricsLogger:
    """metrics.jsonl plus TensorBoard (when the tensorboard package is importable)."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = True) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self._writer = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415

                self._writer = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                logger.warning("tensorboard is not installed: no event files (pip install tensorboard)")

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self._writer is not None:
            step = record["step"]
            for key, value in record.items():
                if key not in ("step", "time") and isinstance(value, (int, float)):
                    self._writer.add_scalar(f"train/{key}" if key != "val_loss" else "val/loss", value, step)
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
