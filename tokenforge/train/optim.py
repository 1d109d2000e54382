"""AdamW and the learning-rate schedule: linear warmup, then linear or cosine decay to min_lr.

In: the trainable parameters and the optimizer settings. Out: the optimizer and a LambdaLR whose
state (the step count) checkpoints with everything else.
"""

from __future__ import annotations

import math

import torch
from torch import nn

SCHEDULERS = ("linear", "cosine", "constant")
OPTIMIZERS = ("adamw",)


def lr_factor(step: int, warmup_steps: int, max_steps: int, scheduler: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at `step` (0-based; the update of step s uses factor(s))."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if scheduler == "constant" or max_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    decay = 1.0 - progress if scheduler == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float],
                    device: torch.device) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    # Norm weights and biases (1-D) take no weight decay, as in nanoGPT and the HF Trainer.
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    sharded = any(type(p).__name__ == "DTensor" for p in params)
    # fused=True for plain CUDA tensors; foreach over FSDP2's DTensors (both: one launch per group).
    kwargs = {"fused": True} if device.type == "cuda" and not sharded else {"foreach": device.type == "cuda"}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, **kwargs)


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int, scheduler: str,
                    min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, max_steps, scheduler, min_lr_ratio))
