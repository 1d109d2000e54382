"""EngineCoreClient: the frontend's handle on the engine-core process.

It starts the process (core_boot.CoreProcess: a fresh interpreter, no forked CUDA or thread
state; or adopts the one the CLI entry started before its own imports), binds two ipc sockets in a
private temp dir, hands the core its config and the addresses through the start pipe, sends
InputMessages and receives OutputMessages (core_process.py). A watcher thread waits on the
process sentinel, so a dead core is noticed at once rather than at the next request. The config
crosses as msgpack bytes; nothing here is pickled onto a socket.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from tokenforge.config import EngineConfig
from tokenforge.engine import core_boot
from tokenforge.engine.core_boot import DEFAULT_CORE, CoreProcess
from tokenforge.engine.core_process import (
    AbortRequests,
    AddLoRA,
    AddRequests,
    Fatal,
    InputMessage,
    OutputMessage,
    Ready,
    RemoveLoRA,
    ShutdownRequest,
    StatsRequest,
    encode_config,
)
from tokenforge.engine.startup import StartupRefused
from tokenforge.messages import EngineCoreRequest, LoRARequest

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine-core process exited or crashed; nothing more can be served."""


class EngineCoreClient:
    def __init__(self, config: EngineConfig | None, *, core_path: str = DEFAULT_CORE) -> None:
        self.config = config                    # None: prestart(), then configure()
        self.core_path = core_path
        self._dir = tempfile.mkdtemp(prefix="tokenforge-")
        self.input_address = f"ipc://{os.path.join(self._dir, 'input.sock')}"
        self.output_address = f"ipc://{os.path.join(self._dir, 'output.sock')}"
        self._sync_context = zmq.Context()
        self._async_context = zmq.asyncio.Context()
        self._input = self._sync_context.socket(zmq.PUSH)
        # No high-water mark: with the core connected a send never blocks, and without it (dead,
        # or never started) a NOBLOCK send fails at once instead of blocking forever.
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.bind(self.input_address)
        self._output = self._async_context.socket(zmq.PULL)
        self._output.bind(self.output_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(OutputMessage)
        self.process: CoreProcess | None = None
        self.ready: Ready | None = None
        self.dead_reason: str | None = None
        self._closing = False

    # ---- lifecycle --------------------------------------------------------------------------------
    @classmethod
    def prestart(cls, core_path: str = DEFAULT_CORE) -> EngineCoreClient:
        """A core started before the config is known: the one the CLI entry started as its first
        statement (core_boot.launch_early), or one started now. It imports torch and the engine
        while this process checks the flags, then waits for `configure`."""
        client = cls(None, core_path=core_path)
        early = core_boot.take_early()
        if early is not None:
            client.process = early
            logger.debug("engine core process started (pid %d) at the command's first instant", early.pid)
        else:
            client.spawn()
        return client

    def spawn(self) -> None:
        """Start the core; with a config it is handed over at once (else `configure` does)."""
        self.process = CoreProcess(self.core_path)
        core_boot.mark("core_spawned", self.process.spawned_at)
        if self.config is not None:
            self._start(self.config)
        logger.log(logging.INFO if self.config is not None else logging.DEBUG,
                   "engine core process started (pid %d)", self.process.pid)

    def _start(self, config: EngineConfig, prestarted: bool = False) -> None:
        try:
            self.process.start(encode_config(config), self.input_address, self.output_address,
                               logging.getLogger().getEffectiveLevel(), self.core_path, prestarted)
        except OSError as err:      # the core died while importing
            self.process.join(1.0)
            raise EngineDeadError(f"engine core process exited with code {self.process.exitcode} "
                                  f"during start-up ({err})") from err
        core_boot.mark("config_sent")

    def configure(self, config: EngineConfig) -> None:
        """Hand a pre-started core its config; it starts loading the model."""
        if self.process is None or self.process.started or self.config is not None:
            raise RuntimeError("configure() is for a core started with prestart()")
        self.config = config
        self._start(config, prestarted=True)
        # DEBUG: a config the core refuses must leave the one error line alone (the core logs
        # "config resolved" once it accepts it).
        logger.debug("engine core process configured (pid %d, pre-started)", self.process.pid)

    async def wait_ready(self, timeout: float | None = None,
                         also: concurrent.futures.Future | None = None) -> Ready:
        """Wait for the core's Ready; raise EngineDeadError if it failed or exited first,
        StartupRefused if it refused the config (engine/startup.py), or the exception of `also`
        (work done meanwhile in this process) as soon as that fails."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if also is not None and also.done() and also.exception() is not None:
                raise also.exception()
            if await self._output.poll(200, zmq.POLLIN):
                message = self._decoder.decode(await self._output.recv())
                if isinstance(message, Ready):
                    self.ready = message
                    return message
                if isinstance(message, Fatal):
                    raise (StartupRefused if message.refused else EngineDeadError)(message.message)
                continue
            if not self.process.is_alive():
                raise EngineDeadError(f"engine core process exited with code {self.process.exitcode} during start-up")
            if deadline is not None and loop.time() > deadline:
                raise EngineDeadError(f"engine core not ready after {timeout} s")

    def watch(self, on_death: Callable[[str], None], loop: asyncio.AbstractEventLoop) -> None:
        """Call `on_death(reason)` on `loop` as soon as the process exits unexpectedly."""
        process = self.process

        def wait() -> None:
            multiprocessing.connection.wait([process.sentinel])
            process.join(2.0)       # the life pipe closes a moment before the exit status is there
            if not self._closing:
                reason = f"engine core process died (exit code {process.exitcode})"
                loop.call_soon_threadsafe(on_death, reason)

        threading.Thread(target=wait, name="engine-core-watcher", daemon=True).start()

    def is_alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._closing = True
        process = self.process
        if process is not None and not process.started:    # never configured (a bad flag): nothing to drain
            process.kill()
            process.join(2.0)
        if process is not None and process.is_alive():
            try:
                self.send(ShutdownRequest())
            except (zmq.ZMQError, EngineDeadError):
                pass
            # A core that never became ready reads no messages: do not wait on it.
            process.join(timeout if self.ready is not None else 0.2)
            if process.is_alive():
                if self.ready is not None:
                    logger.warning("engine core did not stop within %.0f s; killing it", timeout)
                process.kill()
                process.join(2.0)
        if process is not None:
            process.close()
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._sync_context.term()
        self._async_context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- messages ---------------------------------------------------------------------------------
    def send(self, message: InputMessage) -> None:
        # Never blocks (no HWM), so aborts can be sent from `finally` blocks of cancelled tasks
        # without awaiting; zmq.Again means no core is connected to read it.
        try:
            self._input.send(self._encoder.encode(message), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise EngineDeadError("the engine core is not connected (it exited or never started)") from None

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self.send(AddRequests(requests))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.send(AbortRequests(request_ids))

    def request_stats(self) -> None:
        self.send(StatsRequest())

    def add_lora(self, token: int, lora: LoRARequest) -> None:
        self.send(AddLoRA(token, lora))

    def remove_lora(self, token: int, name: str) -> None:
        self.send(RemoveLoRA(token, name))

    async def recv(self) -> OutputMessage:
        return self._decoder.decode(await self._output.recv())
