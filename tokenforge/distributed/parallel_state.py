"""Process groups for tensor and pipeline parallelism.

In: this process's place in the world (`ParallelRank`) and a rendezvous address. Out: the
process-wide groups every collective uses: the tensor-parallel group (all-reduce, all-gather,
the sampled-token broadcast), the pipeline group (hidden-state send/recv between stages) and a
gloo group over the whole world for control messages (step broadcasts across hosts).

Ranks are laid out TP-major: rank = pp_rank * tp_size + tp_rank, so a stage's TP ranks are
neighbours (one NVLink island on a multi-GPU host). Groups are process-wide state, like
torch.distributed's own default group: one engine per process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenforge import envs

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ParallelRank:
    rank: int
    tp_size: int = 1
    pp_size: int = 1
    local_rank: int = 0              # the device index on this host

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank of this TP position in another stage."""
        return pp_rank * self.tp_size + self.tp_rank


@dataclass(slots=True)
class _Groups:
    rank: ParallelRank
    tp: dist.ProcessGroup | None
    pp: dist.ProcessGroup | None
    cpu: dist.ProcessGroup | None        # gloo over the world: control messages


_GROUPS: _Groups | None = None


TIMEOUT_ENV = envs.DIST_TIMEOUT_S     # collectives and rendezvous give up after this long


def init_distributed(rank: ParallelRank, backend: str, init_method: str, timeout_s: float | None = None) -> None:
    """Join the world and build every group (all ranks create all groups, in the same order)."""
    global _GROUPS
    timeout = timedelta(seconds=timeout_s or envs.dist_timeout_s())
    if backend == "nccl":
        torch.cuda.set_device(rank.local_rank)      # NCCL picks its device from the current one
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank.rank, world_size=rank.world_size,
                                timeout=timeout)
    tp_group = pp_group = None
    for pp in range(rank.pp_size):
        ranks = [pp * rank.tp_size + t for t in range(rank.tp_size)]
        group = dist.new_group(ranks, backend=backend, timeout=timeout)
        if pp == rank.pp_rank:
            tp_group = group
    for tp in range(rank.tp_size):
        ranks = [p * rank.tp_size + tp for p in range(rank.pp_size)]
        group = dist.new_group(ranks, backend=backend, timeout=timeout)
        if tp == rank.tp_rank:
            pp_group = group
    cpu = dist.new_group(list(range(rank.world_size)), backend="gloo", timeout=timeout) \
        if backend != "gloo" else dist.group.WORLD
    _GROUPS = _Groups(rank, tp_group, pp_group, cpu)
    logger.info("rank %d of %d joined (tp %d/%d, pp %d/%d, %s)", rank.rank, rank.world_size, rank.tp_rank,
                rank.tp_size, rank.pp_rank, rank.pp_size, backend)


def is_initialized() -> bool:
    return _GROUPS is not None


def parallel_rank() -> ParallelRank:
    return _GROUPS.rank if _GROUPS is not None else ParallelRank(0)


def tp_group() -> dist.ProcessGroup | None:
    return _GROUPS.tp if _GROUPS is not None else None


def pp_group() -> dist.ProcessGroup | None:
    return _GROUPS.pp if _GROUPS is not None else None


def cpu_group() -> dist.ProcessGroup | None:
    return _GROUPS.cpu if _GROUPS is not None else None


def destroy_distributed() -> None:
    global _GROUPS
    _GROUPS = None
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:   # noqa: BLE001 - a peer may be gone already; nothing left to release
            logger.debug("destroy_process_group failed", exc_info=True)


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def set_nccl_env() -> None:
    """NVLink multicast (NVLS) off: it reserves memory and some hosts lack the driver support."""
    envs.set_default("NCCL_NVLS_ENABLE", "0")
    envs.set_default("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")


def torch_device_for(rank: ParallelRank, device: str) -> torch.device:
    if device == "cuda":
        torch.cuda.set_device(rank.local_rank)
        return torch.device("cuda", rank.local_rank)
    return torch.device("cpu")
