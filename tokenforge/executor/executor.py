"""Executor: the engine's one handle on the workers that run the model.

In: an EngineConfig. Out: `execute(SchedulerOutput) -> ModelRunnerOutput`, plus the facts the
engine needs once (the KV block count, the vocabulary, the model's context limit). Today one
in-process worker; tensor/pipeline-parallel executors implement the same three methods.
"""

from __future__ import annotations

import logging
import os
import time

from tokenforge.config import EngineConfig
from tokenforge.core.outputs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class Executor:
    def __init__(self, config: EngineConfig) -> None:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        from tokenforge.executor.model_runner import ModelRunner  # noqa: PLC0415 - after the env var

        start = time.perf_counter()
        self.runner = ModelRunner(config)
        self.load_seconds = time.perf_counter() - start
        logger.info("model loaded in %.2f s (%s, %s)", self.load_seconds, self.runner.device, self.runner.dtype)

    @property
    def arch(self):
        return self.runner.arch

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def init_kv_cache(self, config: EngineConfig) -> int:
        from tokenforge.executor.kv_cache import determine_kv_sizing  # noqa: PLC0415

        sizing = determine_kv_sizing(self.runner, config, config.scheduler.max_model_len)
        logger.info("%s", sizing.summary(config.cache.block_size, config.scheduler.max_model_len))
        self.sizing = sizing
        self.runner.init_kv_cache(sizing.num_blocks)
        return sizing.num_blocks

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(scheduler_output)

    def allocator_fragmentation(self) -> float:
        return self.runner.allocator_fragmentation()

    def shutdown(self) -> None:
        self.runner = None
