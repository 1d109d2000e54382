"""Process groups and model wrapping for training: one process, or DDP / FSDP2 under torchrun.

In: the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK), the strategy, the device.
Out: a `Dist` (rank facts plus the collectives the trainer needs) and the wrapped model.

Order of wrapping follows torchtitan: activation checkpointing and torch.compile per decoder layer
first, then `fully_shard` per layer and on the root (FSDP2), or one DDP wrapper. FSDP2 holds fp32
master weights and computes in bf16 (MixedPrecisionPolicy); DDP and one process use autocast.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tokenforge import envs

logger = logging.getLogger(__name__)
STRATEGIES = ("none", "ddp", "fsdp")


@dataclass(frozen=True, slots=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled and self.world_size > 1:
            dist.all_reduce(x)
        return x

    def barrier(self) -> None:
        if self.enabled and self.world_size > 1:
            dist.barrier()

    def broadcast_flag(self, flag: bool) -> bool:
        """Rank 0's value of `flag` on every rank (so all ranks stop on the same step)."""
        if not (self.enabled and self.world_size > 1):
            return flag
        t = torch.tensor([1 if flag else 0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


def init_distributed(device: str = "auto") -> Dist:
    """Join torchrun's process group when WORLD_SIZE is set (NCCL on CUDA, gloo on the CPU)."""
    world = envs.world_size()
    rank, local_rank = envs.rank(), envs.local_rank()
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=10),
                                device_id=dev if use_cuda else None)
    return Dist(rank, world, local_rank, dev)


def destroy_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return list(model.model.layers)


def prepare_layers(model: nn.Module, activation_checkpointing: bool, compile_layers: bool) -> None:
    """Per decoder layer: recompute in backward, and compile the layer in place
    (`module.compile()`), which keeps parameter names unchanged for checkpoints and export. The
    layers share code, so dynamo compiles the block once; FSDP2's hooks are skipped by dynamo."""
    for layer in decoder_layers(model):
        layer.activation_checkpointing = activation_checkpointing
        if compile_layers:
            layer.compile()


def wrap_model(model: nn.Module, strategy: str, d: Dist, param_dtype: torch.dtype) -> nn.Module:
    """The model to call in the training step; the returned module's `.module` (DDP) or itself
    (FSDP2, none) owns the parameters."""
    if strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        mesh = _mesh(d)
        layers = decoder_layers(model)
        for i, layer in enumerate(layers):
            # The last layer's weights are needed again at once by backward: keep them gathered.
            # With one rank there is nothing to free by resharding, only casts to redo.
            reshard = d.world_size > 1 and i < len(layers) - 1
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

        ids = [d.device.index] if d.device.type == "cuda" else None
        # bucket_cap_mb: larger buckets, fewer all-reduce launches for a 1B model.
        return DDP(model, device_ids=ids, bucket_cap_mb=100, gradient_as_bucket_view=True)
    return model


def _mesh(d: Dist):
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    if not d.enabled:     # FSDP2 on one process still needs a (size-1) group
        init_single_process_group(d)
    return init_device_mesh(d.device.type, (d.world_size,))


def init_single_process_group(d: Dist) -> None:
    envs.set_default("MASTER_ADDR", "127.0.0.1")
    envs.set_default("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if d.device.type == "cuda" else "gloo", rank=0, world_size=1)


def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def set_gradient_sync(model: nn.Module, strategy: str, enabled: bool):
    """A context manager (DDP no_sync) or a setting (FSDP2) that skips the gradient reduction on
    all but the last micro batch of a step."""
    import contextlib  # noqa: PLC0415

    if strategy == "ddp" and not enabled:
        return model.no_sync()
    if strategy == "fsdp":
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()
