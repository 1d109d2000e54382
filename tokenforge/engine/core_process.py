"""The engine-core process: EngineCore behind two ZMQ sockets, typed msgpack both ways.

In (PULL, from the frontend): AddRequests, AbortRequests, StatsRequest, ShutdownRequest, and
AddLoRA / RemoveLoRA (runtime adapter updates).
Out (PUSH, to the frontend): Ready once the model is loaded (or Fatal if that failed), then
StepOutputs per engine step, Rejected for a request the core refused, Stats snapshots
(periodically while busy, on going idle, and on request), and a LoRAResult per adapter update.

The loop: drain the input socket (blocking briefly only when idle), step while there is work,
push what the step produced. Aborts are drained before every step, so an aborted request's KV
blocks are free by the next step. Nothing on these sockets is ever pickled: every frame is a
msgspec struct from this module. The process exits when told to, when its parent dies, or, with
a Fatal message, when a step raises.
"""

from __future__ import annotations

import importlib
import gc
import logging
import os
import signal
import sys
import time
import traceback

import msgspec
import zmq

from tokenforge.config import EngineConfig, decode_config, encode_config  # noqa: F401 - re-exported
from tokenforge.logs import configure_logging
from tokenforge.messages import EngineCoreOutput, EngineCoreRequest, EngineStats, LoRARequest

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 100          # how long an idle core blocks on its input before re-checking its parent
_STATS_INTERVAL_S = 0.5      # how often a busy core volunteers a stats snapshot


# ---- frontend -> core ---------------------------------------------------------------------------

class AddRequests(msgspec.Struct, tag="add"):
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class StatsRequest(msgspec.Struct, tag="stats_request"):
    pass


class ShutdownRequest(msgspec.Struct, tag="shutdown"):
    pass


class AddLoRA(msgspec.Struct, tag="add_lora"):
    token: int                   # echoed in the LoRAResult
    lora: LoRARequest


class RemoveLoRA(msgspec.Struct, tag="remove_lora"):
    token: int
    name: str


InputMessage = AddRequests | AbortRequests | StatsRequest | ShutdownRequest | AddLoRA | RemoveLoRA


# ---- core -> frontend ---------------------------------------------------------------------------

class Ready(msgspec.Struct, tag="ready"):
    pid: int
    num_kv_blocks: int
    vocab_size: int
    max_model_len: int
    startup_phases: dict[str, float] = msgspec.field(default_factory=dict)   # seconds (EngineCore's)
    config: bytes = b""          # the resolved EngineConfig (encode_config): device, batch limits, context
    marks: dict[str, float] = msgspec.field(default_factory=dict)   # start-up events, time.time() (core_boot)


class StepOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    step_start: float            # time.time() when the step that produced them began


class Rejected(msgspec.Struct, tag="rejected"):
    request_id: str              # a child (engine-core) request id
    message: str


class Stats(msgspec.Struct, tag="stats"):
    stats: EngineStats


class Fatal(msgspec.Struct, tag="fatal"):
    message: str
    refused: bool = False        # the config cannot run here (engine/startup.py): a bad flag, not a crash


class LoRAResult(msgspec.Struct, tag="lora_result"):
    token: int
    error: str | None = None     # None: done (for a removal, `found` says whether it was there)
    found: bool = True


OutputMessage = Ready | StepOutputs | Rejected | Stats | Fatal | LoRAResult


def load_core_class(path: str):
    """'package.module:Class' -> the class (tests substitute a fake core this way)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class CoreLoop:
    def __init__(self, core, input_socket: zmq.Socket, output_socket: zmq.Socket, parent_pid: int) -> None:
        self.core = core
        self.input = input_socket
        self.output = output_socket
        self.parent_pid = parent_pid
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(InputMessage)
        self.poller = zmq.Poller()
        self.poller.register(input_socket, zmq.POLLIN)
        self.stopping = False
        self.last_stats = 0.0

    def send(self, message: OutputMessage) -> None:
        self.output.send(self.encoder.encode(message), copy=False)

    def run(self) -> None:
        was_busy = False
        # Start-up work left for idle time (EngineCore.idle_work: the deferred CUDA graphs), done
        # one piece per pass, only when the input was just drained and no request is queued or running.
        idle_work = getattr(self.core, "idle_work", None)
        while not self.stopping:
            busy = self.core.has_unfinished_requests()
            self.drain(timeout_ms=0 if busy or idle_work is not None else _IDLE_POLL_MS)
            if self.stopping:
                break
            if self.core.has_unfinished_requests():
                self.step()
                was_busy = True
                if time.monotonic() - self.last_stats > _STATS_INTERVAL_S:
                    self.send_stats()
            elif was_busy:
                self.send_stats()     # the idle snapshot: 0 running, blocks returned
                was_busy = False
            elif idle_work is not None and not idle_work():
                idle_work = None      # all done: idle passes block on the input again
            if os.getppid() != self.parent_pid:
                logger.warning("engine core: parent process %d is gone, exiting", self.parent_pid)
                break

    def drain(self, timeout_ms: int) -> None:
        if not self.poller.poll(timeout_ms):
            return
        while True:
            try:
                frame = self.input.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.handle(self.decoder.decode(frame.buffer))

    def handle(self, message: InputMessage) -> None:
        if isinstance(message, AddRequests):
            for request in message.requests:
                try:
                    self.core.add_request(request)
                except ValueError as err:
                    self.send(Rejected(request.request_id, str(err)))
        elif isinstance(message, AbortRequests):
            self.core.abort_requests(message.request_ids)
        elif isinstance(message, StatsRequest):
            self.send_stats()
        elif isinstance(message, ShutdownRequest):
            self.stopping = True
        elif isinstance(message, AddLoRA):
            try:
                self.core.add_lora(message.lora)
                self.send(LoRAResult(message.token))
            except ValueError as err:
                self.send(LoRAResult(message.token, str(err)))
        elif isinstance(message, RemoveLoRA):
            self.send(LoRAResult(message.token, found=self.core.remove_lora(message.name)))

    def step(self) -> None:
        start = time.time()
        outputs = self.core.step()
        if outputs:
            self.send(StepOutputs(outputs, start))

    def send_stats(self) -> None:
        self.last_stats = time.monotonic()
        self.send(Stats(self.core.get_stats()))


def _ready_message(core, marks: dict[str, float]) -> Ready:
    runtime = getattr(core, "runtime", None)
    phases = dict(getattr(core, "startup_phases", None) or {})
    config = encode_config(core.config) if getattr(core, "config", None) is not None else b""
    facts = runtime if runtime is not None else core
    return Ready(os.getpid(), facts.num_kv_blocks, facts.vocab_size, facts.max_model_len, phases, config, marks)


def _timing(marks: dict[str, float]) -> str:
    """What the core did before its config was resolved, for the log line once it is accepted."""
    if "engine_code" not in marks:
        return "config received"
    imported = marks["engine_code"] - marks["core_boot"]
    waited = max(0.0, marks.get("config", 0.0) - marks["engine_code"])
    return f"imports done in {imported:.2f} s, then {waited:.2f} s waiting for the config"


def _resolve(config: EngineConfig, timing: str) -> EngineConfig:
    """The device, the batch limits and the fit, settled here (engine/startup.py) for a config the
    frontend left unresolved (serve's API process imports no torch); logged once accepted, so a
    refused config leaves the frontend's one error line alone on the terminal."""
    from tokenforge.engine.startup import resolve_engine_config  # noqa: PLC0415 - imports torch

    start = time.perf_counter()
    resolved = resolve_engine_config(config)
    s = resolved.scheduler
    logger.info("engine core: %s; config resolved in %.2f s (%s, max_num_seqs %d, max_num_batched_tokens %d)",
                timing, time.perf_counter() - start, resolved.device.device, s.max_num_seqs,
                s.max_num_batched_tokens)
    return resolved


def run_engine_core(config_bytes: bytes, input_address: str, output_address: str, parent_pid: int,
                    core_path: str, log_level: int = logging.INFO, prestarted: bool = False,
                    marks: dict[str, float] | None = None) -> None:
    """The core loop, once core_boot.main has the config (msgpack bytes, never a pickle).
    `prestarted`: the core was started before its config (it imported meanwhile), which it
    resolves whatever it says; `marks`: its start-up so far (core_boot), sent back with Ready."""
    # The frontend owns shutdown: Ctrl-C on the terminal or a SIGTERM to the process group must
    # not kill the core while the server is still draining in-flight requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(log_level, "engine-core")
    marks = dict(marks or {})
    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)
    input_socket.connect(input_address)
    output_socket = context.socket(zmq.PUSH)
    output_socket.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    exit_code = 0
    core = None
    try:
        config = decode_config(config_bytes)
        try:
            start = time.perf_counter()
            if config.needs_device or prestarted:
                marks["resolve_start"] = time.time()
                config = _resolve(config, _timing(marks))
                marks["resolve_end"] = time.time()
            core = load_core_class(core_path)(config)
        except Exception as err:   # noqa: BLE001 - any load failure is reported, not raised
            # The frontend prints the one line; the traceback is for --log-level debug.
            logger.debug("engine core failed to start", exc_info=True)
            refused = _is_refusal(err)
            output_socket.send(encoder.encode(
                Fatal(str(err) if refused else f"engine core failed to start: {_one_line(err)}", refused)))
            exit_code = 1
            return
        logger.info("engine core ready in %.2f s", time.perf_counter() - start)
        marks.update(getattr(core, "startup_marks", None) or {})
        marks["ready"] = time.time()
        output_socket.send(encoder.encode(_ready_message(core, marks)))
        # The model, its tensors' Python objects and the engine's tables live for the whole run:
        # move them out of the cyclic GC, so its full passes scan only what the steps allocate
        # (a full pass over the start-up heap is a host stall the step loop cannot hide). After
        # Ready: the pass runs while the frontend builds its app, not before /health can answer.
        gc.collect()
        gc.freeze()
        CoreLoop(core, input_socket, output_socket, parent_pid).run()
    except Exception:   # noqa: BLE001 - a crashed step must reach the frontend as a message
        message = traceback.format_exc()
        logger.error("engine core crashed:\n%s", message)
        output_socket.send(encoder.encode(Fatal(f"engine core crashed: {message.strip().splitlines()[-1]}")))
        exit_code = 1
    finally:
        if core is not None:
            try:
                core.shutdown()
            except Exception:   # noqa: BLE001
                logger.exception("engine core shutdown failed")
        output_socket.close(linger=1000)   # let the last message (Fatal or stats) reach the frontend
        input_socket.close(linger=0)
        context.term()
        # os._exit, not sys.exit: a thread some library left running must not keep a failed core
        # alive (the frontend would wait on it), and the start pipe's reader thread must not either.
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(exit_code)


def _is_refusal(err: BaseException) -> bool:
    from tokenforge.engine.startup import StartupRefused  # noqa: PLC0415

    return isinstance(err, StartupRefused)


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text and not isinstance(err, ValueError) else (
        text[0] if text else type(err).__name__)
