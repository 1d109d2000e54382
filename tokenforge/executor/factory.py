"""Which executor runs a config: one in-process runner, one process per rank on this host (mp),
or this process's rank under torchrun. The layout is checked against the model and the host
first, so a bad one fails before any process starts or any memory is allocated."""

from __future__ import annotations

from tokenforge import envs
from tokenforge.config import EngineConfig
from tokenforge.distributed.parallel_state import ParallelRank
from tokenforge.executor.executor import Executor
from tokenforge.executor.parallel_check import check_parallel_layout
from tokenforge.executor.spec.draft import check_draft_model
from tokenforge.executor.spec.eagle import check_eagle_config


def torchrun_rank(config: EngineConfig) -> ParallelRank | None:
    """This process's rank when torchrun (or any launcher setting RANK/WORLD_SIZE) started it."""
    world = envs.world_size()
    backend = config.parallel.distributed_executor_backend
    if backend == "mp" or backend == "uni" or (backend == "auto" and world <= 1):
        return None
    tp, pp = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
    if world != tp * pp:
        raise ValueError(f"torchrun started {world} processes (WORLD_SIZE), but tensor_parallel_size x "
                         f"pipeline_parallel_size = {tp} x {pp} = {tp * pp}")
    return ParallelRank(envs.rank(), tp, pp, envs.local_rank())


def create_executor(config: EngineConfig):
    from tokenforge.model.loader import read_arch_config  # noqa: PLC0415

    check_draft_model(config)
    check_eagle_config(config)
    rank = torchrun_rank(config)
    if config.parallel.world_size == 1 and rank is None:
        return Executor(config)
    arch = read_arch_config(config.model.model, config.load.load_format)
    local = envs.local_world_size(config.parallel.world_size) if rank is not None else None
    check_parallel_layout(config, arch, config.device.resolved_device(), local)
    from tokenforge.executor.multiproc import MultiprocExecutor  # noqa: PLC0415

    return MultiprocExecutor(config, torchrun_rank=rank)


def create_worker_for_torchrun(config: EngineConfig) -> int:
    """Ranks 1..N-1 under torchrun: check the layout like rank 0 does, then serve as a worker."""
    from tokenforge.executor.worker import run_torchrun_worker  # noqa: PLC0415
    from tokenforge.model.loader import read_arch_config  # noqa: PLC0415

    rank = torchrun_rank(config)
    if rank is None:
        raise ValueError("not started by torchrun (WORLD_SIZE is 1)")
    arch = read_arch_config(config.model.model, config.load.load_format)
    check_parallel_layout(config, arch, config.device.resolved_device(),
                          envs.local_world_size(config.parallel.world_size))
    return run_torchrun_worker(config, rank)
