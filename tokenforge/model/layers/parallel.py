"""Tensor-parallel helpers shared by the layers: shard arithmetic and the two collectives.

With tp_size 1 the collectives are never called; with tp_size > 1 they run over this rank's
tensor-parallel group, which `tokenforge.distributed.parallel_state` sets up (NCCL on CUDA, where
they are captured into the decode CUDA graphs; gloo on the CPU).
"""

from __future__ import annotations

import inspect
import weakref

import torch
import torch.distributed as dist
from torch import nn

from tokenforge.distributed.parallel_state import tp_group


def divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x, group=tp_group())
    return x


def all_gather_last_dim(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """[..., N] on each rank -> [..., tp_size * N] in rank order."""
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x.contiguous(), group=tp_group())
    return torch.cat(parts, dim=-1)


def new_parameter(*shape: int, dtype: torch.dtype | None, weight_loader,
                  device: torch.device | None = None) -> nn.Parameter:
    """An uninitialised parameter on `device` (None: the current default device), carrying its
    weight_loader.

    Uninitialised on purpose: the loader (or the dummy initialiser) writes every value, and
    default nn.Linear init would cost seconds on a large model.
    """
    param = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))
    param.weight_loader = _without_cycle(weight_loader)
    return param


def _without_cycle(loader):
    """A layer's bound-method loader stored on its own parameter would form a reference cycle
    (layer -> param -> method -> layer), so a deleted model's GPU memory would wait for the
    garbage collector. Hold the method weakly instead."""
    if not inspect.ismethod(loader):
        return loader
    ref = weakref.WeakMethod(loader)

    def weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        method = ref()
        assert method is not None, "weight_loader called after its layer was freed"
        method(param, loaded, shard_id)

    return weight_loader


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    assert shard_id is None, "an unsharded parameter takes no shard_id"
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)
