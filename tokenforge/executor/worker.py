"""A worker: one rank's model runner, driven by the step messages of the engine core (rank 0).

In: msgspec-encoded `WorkerMessage`s from a channel (a shared-memory ring on one host, a gloo
broadcast across hosts). Out: nothing on the channel; the worker's results reach rank 0 through
the collectives inside the model (all-reduce, hidden-state send/recv). Rank 0 runs the same
handlers in-process (`RankHandlers`), so every rank does the same collectives in the same order.

A worker process exits when told to (WorkerShutdown), when its parent dies (PR_SET_PDEATHSIG on
Linux, plus a parent-pid check while it waits), or non-zero when anything raises.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import sys

import msgspec
import torch
import torch.distributed as dist

from tokenforge import envs
from tokenforge.config import EngineConfig, decode_config
from tokenforge.distributed import parallel_state
from tokenforge.distributed.channel import BroadcastChannel, ShmChannel
from tokenforge.distributed.parallel_state import ParallelRank
from tokenforge.distributed.shm_ring import RingClosedError, ShmRing
from tokenforge.messages import (WorkerFinishStep, WorkerInitKVCache, WorkerMessage, WorkerProfile,
                                 WorkerShutdown, WorkerStep)

logger = logging.getLogger(__name__)

FAULT_ENV = envs.FAULT_RANK     # tests: "start:R" makes rank R fail while starting


class RankHandlers:
    """What every rank does for each message; rank 0 calls these beside sending the message."""

    def __init__(self, config: EngineConfig) -> None:
        from tokenforge.executor.model_runner import ModelRunner  # noqa: PLC0415 - after the env vars

        self.config = config
        self.runner = ModelRunner(config)
        self.sizing = None

    def init_kv_cache(self, max_model_len: int) -> int:
        from tokenforge.executor.kv_cache import determine_kv_sizing  # noqa: PLC0415

        sizing = determine_kv_sizing(self.runner, self.config.with_max_model_len(max_model_len), max_model_len)
        if parallel_state.is_initialized():
            # Every rank holds the same blocks (of its own heads and layers): take the smallest.
            blocks = torch.tensor([sizing.num_blocks], dtype=torch.int64)
            dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=parallel_state.cpu_group())
            sizing.num_blocks = int(blocks.item())
            sizing.kv_bytes = sizing.num_blocks * sizing.block_bytes
        self.sizing = sizing
        self.runner.init_kv_cache(sizing.num_blocks, max_model_len)
        return sizing.num_blocks


def run_worker(config_bytes: bytes, rank: ParallelRank, ring_handle: tuple | None, init_method: str,
               parent_pid: int, log_level: int = logging.INFO) -> None:
    """A spawned worker process's entry point (the mp executor)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the engine core owns shutdown
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1 PID`: where is it stuck?
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [worker {rank.rank}] %(name)s: %(message)s")
    config = decode_config(config_bytes)
    _maybe_inject_fault("start", rank.rank)
    parallel_state.init_distributed(rank, parallel_state.backend_for(config.device.resolved_device()), init_method)
    handlers = RankHandlers(config)
    # A GPU worker spins up to 50 ms for the next step (it has a core to itself; a late wake-up
    # stalls the all-reduces); on the CPU the ranks share the cores, so it sleeps sooner.
    spin = 0.05 if config.device.resolved_device() == "cuda" else 0.002
    channel = ShmChannel(ShmRing.attach(ring_handle), rank.rank - 1, alive=lambda: os.getppid() == parent_pid,
                         spin_s=spin)
    code = serve_rank(handlers, channel)
    sys.exit(code)


def serve_rank(handlers: RankHandlers, channel) -> int:
    """The worker loop: decode a message, run it, repeat. Returns the process exit code."""
    decoder = msgspec.msgpack.Decoder(WorkerMessage)
    runner = handlers.runner
    try:
        while True:
            message = decoder.decode(channel.recv())
            if isinstance(message, WorkerStep):
                runner.launch(message)
            elif isinstance(message, WorkerFinishStep):
                if runner.rank.is_first_stage:     # later stages finished the step as it came
                    runner.finish_stages()
            elif isinstance(message, WorkerInitKVCache):
                handlers.init_kv_cache(message.max_model_len)
            elif isinstance(message, WorkerProfile):
                _profile(runner, message.start)
            elif isinstance(message, WorkerShutdown):
                return 0
    except RingClosedError:
        logger.error("the engine core is gone; worker exiting")
        return 1
    finally:
        channel.close()
        parallel_state.destroy_distributed()


def _profile(runner, start: bool) -> None:
    """Workers run the steps but keep no trace of their own: rank 0's trace has the timeline."""


def run_torchrun_worker(config: EngineConfig, rank: ParallelRank) -> int:
    """A rank other than 0 under torchrun: join, load, then follow rank 0's broadcasts."""
    parallel_state.init_distributed(rank, parallel_state.backend_for(config.device.resolved_device()), "env://")
    handlers = RankHandlers(config)
    return serve_rank(handlers, BroadcastChannel())


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when the process that spawned it dies, however it dies."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        except OSError:
            pass


def _maybe_inject_fault(phase: str, rank: int) -> None:
    if envs.fault_rank() == f"{phase}:{rank}":
        raise RuntimeError(f"injected fault: rank {rank} fails during {phase} ({FAULT_ENV})")
