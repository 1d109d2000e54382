"""One optimizer step: micro batches with gradient accumulation, clipping, AdamW, the schedule.

In: the wrapped model, the step's micro batches for this rank (input_ids [B, S], labels [B, S]).
Out: the step's summed loss and token count as device tensors (no host sync: the trainer reads
them only on logging steps) and the gradient norm.

The loss is normalised by the number of loss tokens in the whole global batch (all ranks, all
micro batches), counted before the forward passes, so DDP / FSDP2 averaging over ranks and the
sum over micro batches give exactly the mean over the global batch, as one process would.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from tokenforge.train.loss import IGNORE_INDEX, linear_cross_entropy
from tokenforge.train.parallel import Dist, set_gradient_sync, unwrap


@dataclass(slots=True)
class StepResult:
    loss_sum: torch.Tensor          # summed token loss over the global batch (after the all-reduce)
    tokens: torch.Tensor            # loss tokens in the global batch
    grad_norm: torch.Tensor
    lr: float                       # the learning rate this step's update used

    def mean_loss(self) -> float:
        return (self.loss_sum / self.tokens.clamp(min=1)).item()


class TrainStep:
    def __init__(self, model: nn.Module, strategy: str, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, d: Dist, compute_dtype: torch.dtype,
                 grad_clip: float) -> None:
        self.model, self.strategy, self.optimizer, self.scheduler = model, strategy, optimizer, scheduler
        self.d, self.compute_dtype, self.grad_clip = d, compute_dtype, grad_clip
        # FSDP2 casts parameters itself; one process and DDP keep fp32 weights under autocast.
        self.autocast = d.device.type == "cuda" and compute_dtype != torch.float32 and strategy != "fsdp"
        self.params = [p for p in model.parameters() if p.requires_grad]

    def forward_loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed token loss of one micro batch."""
        ctx = (torch.autocast(self.d.device.type, dtype=self.compute_dtype) if self.autocast
               else contextlib.nullcontext())
        with ctx:
            hidden = self.model(input_ids, None)                        # [B, S, H]
        weight = unwrap(self.model).lm_head.weight                      # [V, H]
        return linear_cross_entropy(hidden, weight, labels, compute_dtype=self.compute_dtype)

    def run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        tokens = sum((labels != IGNORE_INDEX).sum() for _, labels in micro_batches).float()
        tokens = self.d.all_reduce_sum(tokens.reshape(1)).reshape(())
        scale = self.d.world_size / tokens.clamp(min=1)
        loss_sum = torch.zeros((), device=self.d.device)
        for i, (input_ids, labels) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with set_gradient_sync(self.model, self.strategy, last):
                loss = self.forward_loss(input_ids, labels)
                (loss * scale).backward()
            loss_sum += loss.detach()
        grad_norm = self._clip()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(self.d.all_reduce_sum(loss_sum.reshape(1)).reshape(()), tokens, grad_norm, lr)

    def _clip(self) -> torch.Tensor:
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        foreach = True if self.d.device.type == "cuda" else None
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=foreach)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, tokens) over this rank's validation batches, reduced over ranks."""
        loss_sum = torch.zeros((), device=self.d.device)
        tokens = torch.zeros((), device=self.d.device)
        for input_ids, labels in micro_batches:
            loss_sum += self.forward_loss(input_ids, labels).float()
            tokens += (labels != IGNORE_INDEX).sum()
        both = self.d.all_reduce_sum(torch.stack([loss_sum, tokens]))
        return both[0], both[1]
