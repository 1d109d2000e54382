"""The multi-process executor: rank 0 in the engine-core process, one worker process per other rank.

In: an EngineConfig with tensor_parallel_size x pipeline_parallel_size > 1. Out: the Executor
interface. Each step rank 0 encodes the SchedulerOutput as a msgspec `WorkerStep` (token ids,
positions, block tables; never a pickle), writes it into a shared-memory ring that every worker
reads (or, under torchrun, broadcasts the bytes over gloo), then runs the step itself; the ranks
meet in the model's collectives, and rank 0 samples. With pipelined steps, `launch` returns once
the first stage's layers are queued (the next step may start before this one comes back), and
`collect` finishes the oldest step: with TP, it tells the first stage's other ranks to do the same
(`WorkerFinishStep`), so their LM-head collectives meet rank 0's in order.

Failure: a monitor thread waits on the workers' process sentinels. A worker that dies, while
starting or while serving, takes the engine down: the other workers are killed and this process
exits non-zero (the server answers 503 meanwhile), since rank 0 may be blocked in a collective
that will never complete. A failure of rank 0 itself while starting kills the workers too.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import threading

import msgspec

from tokenforge import envs
from tokenforge.config import EngineConfig, encode_config
from tokenforge.core.outputs import SchedulerOutput
from tokenforge.distributed import parallel_state
from tokenforge.distributed.channel import BroadcastChannel, ShmChannel
from tokenforge.distributed.parallel_state import ParallelRank
from tokenforge.distributed.shm_ring import ShmRing
from tokenforge.executor.engine_cache import use_engine_cache
from tokenforge.executor.executor import Executor
from tokenforge.executor.worker import RankHandlers, run_worker
from tokenforge.messages import (WorkerFinishStep, WorkerInitKVCache, WorkerProfile, WorkerSequence,
                                 WorkerShutdown, WorkerStep)

logger = logging.getLogger(__name__)

_DEATH_EXIT_CODE = 1


def to_worker_step(sched: SchedulerOutput) -> WorkerStep:
    return WorkerStep(
        [WorkerSequence(s.request_id, s.token_ids, s.start_position, s.block_table, s.sample, s.prompt_logprob_rows,
                        s.num_draft_tokens)
         for s in sched.sequences], sched.finished_request_ids)


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, torchrun_rank: ParallelRank | None = None) -> None:
        self.config = config
        self.encoder = msgspec.msgpack.Encoder()
        self.workers: list[multiprocessing.process.BaseProcess] = []
        self._closing = False
        self.ring: ShmRing | None = None
        self._init_state()         # no KV tiers here: one process only (parallel_check refuses them)
        device = config.device.resolved_device()
        envs.set_default("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        use_engine_cache(config)       # before the workers start: they inherit the environment
        if device == "cuda":
            parallel_state.set_nccl_env()
        try:
            if torchrun_rank is None:
                rank, init_method = self._spawn_workers(config)
                self.channel = ShmChannel(self.ring, None, alive=self._workers_alive)
            else:
                rank, init_method = torchrun_rank, "env://"
                self.channel = BroadcastChannel()
            parallel_state.init_distributed(rank, parallel_state.backend_for(device), init_method)
            self._start_runner(config)
        except BaseException:
            self._kill_workers()
            parallel_state.destroy_distributed()     # a group left joined would hang the next engine's
            raise

    def _start_runner(self, config: EngineConfig) -> None:
        import time  # noqa: PLC0415

        start = time.perf_counter()
        self.handlers = RankHandlers(config)
        self.runner = self.handlers.runner
        self.load_seconds = time.perf_counter() - start

    def _spawn_workers(self, config: EngineConfig) -> tuple[ParallelRank, str]:
        tp, pp = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
        world = tp * pp
        self.ring = ShmRing(num_readers=world - 1)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        context = multiprocessing.get_context("spawn")
        config_bytes = encode_config(config)
        level = logging.getLogger().getEffectiveLevel()
        for r in range(1, world):
            rank = ParallelRank(r, tp, pp, local_rank=r)
            proc = context.Process(target=run_worker, name=f"tokenforge-worker-{r}", daemon=True,
                                   args=(config_bytes, rank, self.ring.handle(), init_method, os.getpid(), level))
            proc.start()
            self.workers.append(proc)
        logger.info("started %d worker processes (pids %s) for TP %d x PP %d", world - 1,
                    ", ".join(str(p.pid) for p in self.workers), tp, pp)
        threading.Thread(target=self._monitor, name="worker-monitor", daemon=True).start()
        return ParallelRank(0, tp, pp, local_rank=0), init_method

    # ---- failure handling ---------------------------------------------------------------------------
    def _workers_alive(self) -> bool:
        return all(p.is_alive() for p in self.workers)

    def _monitor(self) -> None:
        sentinels = {p.sentinel: p for p in self.workers}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closing:
            return
        dead = sentinels[ready[0]]
        dead.join(0.1)
        logger.error("worker %s (pid %d) exited with code %s: shutting the engine down", dead.name, dead.pid,
                     dead.exitcode)
        self._kill_workers()
        logging.shutdown()
        os._exit(_DEATH_EXIT_CODE)   # rank 0 may be blocked in a collective that cannot complete

    def _kill_workers(self) -> None:
        self._closing = True
        for proc in self.workers:
            if proc.is_alive():
                proc.kill()
        for proc in self.workers:
            proc.join(5.0)
        if self.ring is not None:
            self.ring.close()
            self.ring = None

    # ---- the Executor interface -----------------------------------------------------------------------
    def init_kv_cache(self, config: EngineConfig, defer_graphs: bool = False) -> int:
        # Every rank captures every bucket at start-up (ranks capture in step): nothing is deferred.
        max_len = config.scheduler.max_model_len
        self._send(WorkerInitKVCache(max_len))
        num_blocks = self.handlers.init_kv_cache(max_len)
        self.sizing = self.handlers.sizing
        logger.info("per rank: %s", self.sizing.summary(config.cache.block_size, max_len))
        return num_blocks

    def launch(self, scheduler_output: SchedulerOutput, defer_sampling: bool = False):
        # The workers never sample: a deferred sampling changes nothing for them (rank 0 runs the
        # LM head's collectives at launch and broadcasts the sampled ids when it samples).
        if not scheduler_output.is_empty or scheduler_output.finished_request_ids:
            self._send(to_worker_step(scheduler_output))
        return self.runner.launch(scheduler_output, defer_sampling)

    def collect(self, handle):
        if handle.awaits_last_stage and self.config.parallel.tensor_parallel_size > 1:
            self._send(WorkerFinishStep())
        return self.runner.collect(handle)

    def execute(self, scheduler_output: SchedulerOutput):
        return self.collect(self.launch(scheduler_output))

    def start_profile(self) -> None:
        self._send(WorkerProfile(True))
        super().start_profile()

    def stop_profile(self) -> str:
        self._send(WorkerProfile(False))
        return super().stop_profile()

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        try:
            self._send(WorkerShutdown())
        except Exception:   # noqa: BLE001 - a worker may be gone already
            logger.debug("could not send shutdown to the workers", exc_info=True)
        for proc in self.workers:
            proc.join(10.0)
        self._kill_workers()
        parallel_state.destroy_distributed()
        super().shutdown()   # rank 0's own runner: its tensors freed without the GC

    def _send(self, message) -> None:
        self.channel.send(self.encoder.encode(message))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
