"""AsyncEngine: the serving frontend's engine, for one asyncio event loop.

In: prompts (text or token ids) with SamplingParams, from many concurrent HTTP handlers. Out: an
async iterator of delta RequestOutputs per request. Tokenization, validation (Processor) and
detokenization with stop strings (OutputProcessor) run here in the main process; scheduling
and the model run in the engine-core process (core_process.py) behind EngineCoreClient.

One background task reads the core's messages and routes each RequestOutput to its request's
queue. A request whose consumer goes away (client disconnect, timeout, cancellation) is aborted
in the core from the generator's `finally`, so its KV blocks are freed by the next step. If the
core dies, every in-flight request gets EngineDeadError and `is_healthy` turns False at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

from tokenforge.config import EngineConfig, RuntimeInfo, decode_config
from tokenforge.engine import core_boot
from tokenforge.engine.core_boot import DEFAULT_CORE
from tokenforge.engine.core_client import EngineCoreClient, EngineDeadError
from tokenforge.engine.core_process import (
    Fatal,
    LoRAResult,
    Rejected,
    Stats,
    StepOutputs,
)
from tokenforge.engine.output_processor import OutputProcessor
from tokenforge.engine.model_identity import ModelChecksumError, ModelIdentity, verify_model
from tokenforge.engine.processor import Processor
from tokenforge.engine.structured_output import compile_grammar
from tokenforge.engine.request_stream import RequestStream
from tokenforge.messages import EngineStats, LoRARequest, RequestOutput
from tokenforge.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "ModelChecksumError", "ModelIdentity", "RequestAbortedError",
           "RequestStream"]


class RequestAbortedError(RuntimeError):
    """The server aborted the request (for example, its drain time ran out on shutdown)."""


# Both run in daemon threads while the core starts, and return their seconds rather than log them:
# the lines are logged once the core is Ready, so a config the core refuses leaves its one error
# line alone on the terminal.
def _load_tokenizer(config: EngineConfig):
    from tokenforge.engine.tokenization import config_tokenizer  # noqa: PLC0415 - slow import

    start = time.perf_counter()
    core_boot.mark("tokenizer_start")
    tokenizer = config_tokenizer(config)
    core_boot.mark("tokenizer_end")
    return tokenizer, time.perf_counter() - start


def _verify_model(config: EngineConfig):
    start = time.perf_counter()
    identity = verify_model(config)
    return identity, time.perf_counter() - start


def _in_daemon_thread(fn, *args) -> concurrent.futures.Future:
    """Run fn(*args) in a daemon thread: unlike asyncio.to_thread, a failed start-up does not
    wait at exit for it, and its failure is read by whoever waits (never "never retrieved")."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:   # noqa: BLE001 - handed to the waiter
            future.set_exception(err)

    threading.Thread(target=run, name="tokenizer-loader", daemon=True).start()
    return future


class AsyncEngine:
    def __init__(self, config: EngineConfig, runtime: RuntimeInfo, tokenizer, client: EngineCoreClient,
                 stream_interval: int = 1) -> None:
        self.config = config
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.client = client
        self.processor = Processor(config, runtime, tokenizer)
        self.output_processor = OutputProcessor(tokenizer, stream_deltas=True, stream_interval=stream_interval)
        self._streams: dict[str, RequestStream] = {}
        self._child_to_parent: dict[str, str] = {}
        self._num_seqs = 0
        self._stats = EngineStats(num_kv_blocks=runtime.num_kv_blocks, num_free_blocks=runtime.num_kv_blocks)
        self._stats_waiters: list[asyncio.Future] = []
        self._lora_waiters: dict[int, asyncio.Future] = {}      # token -> the LoRAResult's future
        self._lora_tokens = itertools.count()
        self._death_callbacks: list[Callable[[str], None]] = []
        self._output_task: asyncio.Task | None = None
        self.dead_reason: str | None = None
        self.identity = ModelIdentity(config.model.model_version, "")    # start() verifies the weights
        self.startup_phases: dict[str, float] = {}      # the core's, seconds (from its Ready message)
        self.startup_marks: dict[str, float] = {}       # the core's start-up events, time.time() (Ready.marks)

    @classmethod
    async def start(cls, config: EngineConfig, *, core_path: str = DEFAULT_CORE, tokenizer=None,
                    ready_timeout: float | None = None, stream_interval: int = 1,
                    client: EngineCoreClient | None = None) -> AsyncEngine:
        """Spawn the engine core (or configure `client`, one from EngineCoreClient.prestart) and,
        while it loads the model, load the tokenizer here. `stream_interval`: a request's delta is
        released at its first token, at a finish, and otherwise once that many new tokens are
        waiting (1: every step)."""
        if client is None:
            client = EngineCoreClient(config, core_path=core_path)
            client.spawn()
        try:
            if client.config is None:
                client.configure(config)
            # While the core loads the model: the tokenizer, and the weights' checksum (a pinned
            # one that does not match raises ModelChecksumError before the model is waited for).
            checking = _in_daemon_thread(_verify_model, config)
            pending = None if tokenizer is not None else _in_daemon_thread(_load_tokenizer, config)
            identity, checked_s = await asyncio.wrap_future(checking)
            ready = await client.wait_ready(ready_timeout, also=pending)
            core_boot.mark("ready_received")
            logger.info("weights checksum %s in %.2f s", identity.checksum[:16], checked_s)
            if pending is not None:
                tokenizer, loaded_s = await asyncio.wrap_future(pending)
                logger.info("tokenizer loaded in %.2f s", loaded_s)
        except BaseException:
            client.shutdown()
            raise
        runtime = RuntimeInfo(num_kv_blocks=ready.num_kv_blocks, vocab_size=ready.vocab_size,
                              eos_token_ids=tuple(tokenizer.eos_token_ids), max_model_len=ready.max_model_len,
                              max_logprobs=RuntimeInfo.logprobs_limit(config.model.max_logprobs, ready.vocab_size))
        # The core's resolved config (device, batch limits): this process never resolved them itself.
        resolved = decode_config(ready.config) if ready.config else config
        engine = cls(resolved.with_max_model_len(ready.max_model_len), runtime, tokenizer, client, stream_interval)
        engine.identity = identity
        engine.startup_phases = dict(ready.startup_phases)
        engine.startup_marks = dict(ready.marks)
        engine._begin()
        return engine

    def _begin(self) -> None:
        loop = asyncio.get_running_loop()
        self._output_task = loop.create_task(self._route_outputs(), name="engine-output-router")
        self.client.watch(self._mark_dead, loop)

    # ---- public API ------------------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None

    @property
    def num_unfinished_seqs(self) -> int:
        """Sequences admitted and not yet finished (n per request): the server's queue depth."""
        return self._num_seqs

    @property
    def engine_pid(self) -> int | None:
        return self.client.process.pid if self.client.process is not None else None

    def on_death(self, callback: Callable[[str], None]) -> None:
        self._death_callbacks.append(callback)

    async def prepare(self, params: SamplingParams) -> None:
        """Compile the request's grammar (if any) in a worker thread, so that add_request finds it
        cached and neither this event loop nor the engine loop compiles. ValueError if invalid."""
        if params.structured_outputs is not None:
            await asyncio.to_thread(compile_grammar, params.structured_outputs)

    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str,
                    cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> RequestStream:
        """Validate, tokenize and submit now (ValueError for a bad request); outputs arrive on the
        returned stream. Use it as a context manager so an abandoned request is aborted."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.time()
        processed = self.processor.process(prompt, params, request_id, cache_salt=cache_salt, arrival_time=arrival,
                                           lora_request=lora_request)
        stream = RequestStream(self, request_id, arrival, [r.request_id for r in processed.core_requests])
        self.output_processor.add_request(processed, params, arrival)
        self._streams[request_id] = stream
        for child_id in stream.child_ids:
            self._child_to_parent[child_id] = request_id
        self._num_seqs += len(stream.child_ids)
        self.client.add_requests(processed.core_requests)
        return stream

    async def generate(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str,
                       cache_salt: str | None = None, lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yield delta RequestOutputs until the request finishes. Raises ValueError for a bad
        request (before or after it reaches the core) and EngineDeadError if the core dies."""
        with self.add_request(prompt, params, request_id, cache_salt, lora_request) as stream:
            async for output in stream:
                yield output

    def abort(self, request_id: str) -> None:
        """Forget the request here and free its sequences in the core (idempotent)."""
        stream = self._forget(request_id)
        if stream is None:
            return
        stream.finished = True
        child_ids = self.output_processor.abort_request(request_id)
        if child_ids and self.dead_reason is None:
            self.client.abort_requests(child_ids)

    def abort_all(self, reason: str) -> int:
        """End every in-flight request now: each stream gets a last output whose unfinished
        completions carry finish_reason "abort" (then the stream ends), and the core frees their
        KV blocks. Returns how many requests were cut (the server calls this when its drain
        time is up)."""
        request_ids = list(self._streams)
        for request_id in request_ids:
            stream = self._forget(request_id)
            final, child_ids = self.output_processor.finish_aborted(request_id)
            if child_ids and self.dead_reason is None:
                self.client.abort_requests(child_ids)
            stream.put(final if final is not None else RequestAbortedError(reason))
        if request_ids:
            logger.warning("aborted %d in-flight request(s): %s", len(request_ids), reason)
        return len(request_ids)

    async def get_stats(self, timeout: float = 2.0) -> EngineStats:
        """A fresh snapshot from the core, or the last one if it does not answer in time."""
        if self.dead_reason is not None:
            return self._stats
        waiter = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(waiter)
        self.client.request_stats()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except TimeoutError:
            return self._stats

    async def add_lora(self, lora: LoRARequest) -> None:
        """Register an adapter in the core (read, checked, kept in host memory); ValueError
        naming it when it cannot be served."""
        result = await self._lora_call(lambda token: self.client.add_lora(token, lora))
        if result.error is not None:
            raise ValueError(result.error)

    async def remove_lora(self, name: str) -> bool:
        """Forget an adapter in the core; whether it held one of that name."""
        return (await self._lora_call(lambda token: self.client.remove_lora(token, name))).found

    async def _lora_call(self, send) -> LoRAResult:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        token = next(self._lora_tokens)
        waiter = self._lora_waiters[token] = asyncio.get_running_loop().create_future()
        try:
            send(token)
            return await waiter
        finally:
            self._lora_waiters.pop(token, None)

    @property
    def last_stats(self) -> EngineStats:
        return self._stats

    async def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
        await asyncio.to_thread(self.client.shutdown)

    # ---- the output router --------------------------------------------------------------------
    async def _route_outputs(self) -> None:
        while True:
            message = await self.client.recv()
            try:
                self._handle(message)
            except Exception as err:   # noqa: BLE001 - a routing bug must not hang every request
                logger.exception("failed to process engine outputs")
                self._mark_dead(f"frontend failed to process engine outputs: {err}")
                return

    def _handle(self, message) -> None:
        if isinstance(message, StepOutputs):
            self._handle_step(message)
        elif isinstance(message, Stats):
            self._stats = message.stats
            waiters, self._stats_waiters = self._stats_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(message.stats)
        elif isinstance(message, Rejected):
            parent = self._child_to_parent.get(message.request_id)
            if parent is not None:
                self._streams[parent].put(ValueError(message.message))
        elif isinstance(message, LoRAResult):
            waiter = self._lora_waiters.get(message.token)
            if waiter is not None and not waiter.done():
                waiter.set_result(message)
        elif isinstance(message, Fatal):
            self._mark_dead(message.message)

    def _handle_step(self, message: StepOutputs) -> None:
        for out in message.outputs:
            parent = self._child_to_parent.get(out.request_id)
            if parent is not None and self._streams[parent].first_step_start is None:
                self._streams[parent].first_step_start = message.step_start
        processed = self.output_processor.process_outputs(message.outputs)
        if processed.abort_ids:
            self.client.abort_requests(processed.abort_ids)
        for output in processed.request_outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            # Approximate queue time: until the step that produced the first token began.
            output.metrics["queue_time"] = max(0.0, (stream.first_step_start or stream.arrival_time)
                                               - stream.arrival_time)
            stream.put(output)
            if output.finished:
                self._forget(output.request_id)

    def _forget(self, request_id: str) -> RequestStream | None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            for child_id in stream.child_ids:
                self._child_to_parent.pop(child_id, None)
            self._num_seqs -= len(stream.child_ids)
        return stream

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        logger.error("engine is dead: %s", reason)
        self.dead_reason = reason
        for stream in self._streams.values():
            stream.put(EngineDeadError(reason))
        for waiter in self._stats_waiters:
            if not waiter.done():
                waiter.set_result(self._stats)
        for waiter in self._lora_waiters.values():
            if not waiter.done():
                waiter.set_exception(EngineDeadError(reason))
        for callback in self._death_callbacks:
            callback(reason)
