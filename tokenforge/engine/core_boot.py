"""The engine-core process from its first instant: started before `serve` imports anything heavy.

`serve`'s critical path to /health is the core's: import torch and the model code, open the CUDA
context, load, size the KV cache, capture graphs. So the CLI entry starts the core as its first
statement (`launch_early`, before its own imports and argument parsing) and the core imports
while the API process parses the flags, loads the tokenizer and imports the HTTP server; the
config follows through a pipe once the flags are checked (`CoreProcess.start`).

Parent side, `CoreProcess`: a child `python -c` running `main()` here, with two pipes.
- The start pipe carries one message (the engine config as msgpack bytes, the socket addresses,
  the log level, the core class) and then stays open for the parent's whole life: the core
  exits at once (os._exit, from a thread that blocks on it) when it reads end-of-file, i.e. when
  the parent closed it unconfigured (a bad flag) or died in any way, even SIGKILL. No orphan.
- The life pipe is the child's: its end-of-file is the parent's sentinel (the child is gone).
It offers what the client used of multiprocessing.Process: pid, sentinel, is_alive, exitcode,
join, kill. Not multiprocessing's spawn: that re-imports the parent's `__main__` (the whole CLI)
in the child before anything else, which is the time this module exists to save.

Child side, `main`: ignore SIGINT/SIGTERM (the API owns shutdown), start the start-pipe reader,
import torch and the engine code, open the CUDA context in a thread when the config (already
received, as it usually is by then) runs on one GPU, wait for the config, then run the core
loop (core_process.run_engine_core). Every step is a wall-clock mark in `marks`, sent back with
Ready so the API's one-line start-up timeline places both processes on one clock.

Bytecode: where Python may not write `.pyc` files (PYTHONDONTWRITEBYTECODE=1, common in container
images) and torch was installed without them, every start compiled torch's Python sources again:
`import torch` took 3.0-4.1 s of a warm start on the H200 host. The core then keeps its bytecode
under the cache folder (`sys.pycache_prefix`, ~/.cache/tokenforge/bytecode), so only the first
start compiles; TOKENFORGE_BYTECODE_CACHE=0 turns this off. Installs that ship `.pyc` files keep them.

Imports only the standard library (and tokenforge.envs) at module level: the CLI entry imports it first.
"""

from __future__ import annotations

import importlib
import json
import os
import struct
import subprocess
import sys
import threading
import time

from tokenforge import envs

DEFAULT_CORE = "tokenforge.engine.engine_core:EngineCore"
_BOOT = "from tokenforge.engine.core_boot import main; main()"
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# This process's start-up marks (name -> time.time()): the API process's, for the timeline line.
MARKS: dict[str, float] = {}
_early: CoreProcess | None = None


def mark(name: str, at: float | None = None) -> None:
    MARKS[name] = time.time() if at is None else at


def process_start_time() -> float:
    """When this process was exec'd, as time.time() (Linux: /proc, in clock ticks); else now."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return time.time() - max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


# ---- the parent's side ----------------------------------------------------------------------------

class CoreProcess:
    """A started engine-core child that waits for its config (`start`)."""

    def __init__(self, core_path: str = DEFAULT_CORE) -> None:
        self.core_path = core_path
        start_read, self._start_write = os.pipe()
        self.sentinel, life_write = os.pipe()
        spec = json.dumps({"start_fd": start_read, "life_fd": life_write, "core_path": core_path,
                           "sys_path": [p for p in sys.path if p], "parent_pid": os.getpid()})
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        try:
            self._popen = subprocess.Popen([sys.executable, "-c", _BOOT, spec], pass_fds=(start_read, life_write),
                                           env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            for fd in (self._start_write, self.sentinel):
                os.close(fd)
            raise
        finally:
            os.close(start_read)
            os.close(life_write)
        self.spawned_at = time.time()
        self.pid = self._popen.pid
        self.started = False

    def start(self, config_bytes: bytes, input_address: str, output_address: str, log_level: int,
              core_path: str | None = None, prestarted: bool = False) -> None:
        """Send the config: the core starts loading. OSError if it is gone (or never read it).
        `prestarted`: the config is an API process's unresolved one (serve), which the core resolves
        whatever it says; a config handed over at spawn is resolved only if it asks to be."""
        header = json.dumps({"input": input_address, "output": output_address, "log_level": log_level,
                             "core_path": core_path or self.core_path, "prestarted": prestarted}).encode()
        payload = struct.pack("<II", len(header), len(config_bytes)) + header + config_bytes
        view = memoryview(payload)
        while view:
            view = view[os.write(self._start_write, view):]
        self.started = True

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self._popen.poll() is None:
            try:
                self._popen.kill()
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Close the start pipe (an unconfigured or orphaned core exits on it) and the sentinel."""
        for name in ("_start_write", "sentinel"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


def should_launch_early(argv: list[str]) -> bool:
    """Whether argv is a `serve` that will start a core (not --help, not a torchrun follower rank)."""
    words = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--log-level":
            skip = True
        elif arg in ("-h", "--help", "--version") or arg.startswith("@"):
            return False
        elif not arg.startswith("-"):
            words.append(arg)
    if not words or words[0] != "serve":
        return False
    return not (envs.world_size() > 1 and envs.rank() > 0)


_ENTRY_MODULES = ("tokenforge.__main__", "tokenforge.cli.__main__")


def launch_for_entry() -> None:
    """`launch_early(sys.argv[1:])` when this process is the `tokenforge` command (the console
    script, or `python -m tokenforge` / `-m tokenforge.cli`); nothing when tokenforge.cli is
    imported by anything else."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    script = os.path.basename(getattr(main, "__file__", None) or "")
    if (spec is not None and spec.name in _ENTRY_MODULES) or (spec is None and script == "tokenforge"):
        launch_early(sys.argv[1:])


def launch_early(argv: list[str]) -> None:
    """Start the core now if argv is a `serve`; `take_early` hands it to the client."""
    global _early
    mark("api_exec", process_start_time())
    if _early is None and should_launch_early(argv):
        try:
            _early = CoreProcess()
        except OSError:
            return                   # serve starts one later, as it did before
        mark("core_spawned", _early.spawned_at)


def take_early(core_path: str = DEFAULT_CORE) -> CoreProcess | None:
    """The core launch_early started (once; None if none, or if it exited already)."""
    global _early
    early, _early = _early, None
    if early is not None and not early.is_alive():
        early.close()
        return None
    return early


# ---- the child's side -----------------------------------------------------------------------------

class _Inbox:
    """Reads the one start message in a thread, then blocks on the pipe until the parent closes it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.ready = threading.Event()
        self.header: dict = {}
        self.config_bytes = b""
        self.received_at = 0.0
        threading.Thread(target=self._run, name="core-start-pipe", daemon=True).start()

    def _read(self, n: int) -> bytes | None:
        chunks, left = [], n
        while left:
            chunk = os.read(self.fd, left)
            if not chunk:
                return None
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _run(self) -> None:
        try:
            sizes = self._read(8)
            if sizes is not None:
                header_len, config_len = struct.unpack("<II", sizes)
                header, config = self._read(header_len), self._read(config_len)
                if header is not None and config is not None:
                    self.header, self.config_bytes = json.loads(header), config
                    self.received_at = time.time()
                    self.ready.set()
                    while os.read(self.fd, 4096):
                        pass
        except OSError:
            pass
        # The parent stopped before configuring (a bad flag) or is gone: nothing to tell anyone.
        sys.stderr.flush()
        os._exit(0)


def _one_gpu(config_bytes: bytes) -> bool:
    """Whether the config runs on one CUDA device in this process (the context can open early)."""
    from tokenforge.config import decode_config  # noqa: PLC0415

    config = decode_config(config_bytes)
    return config.parallel.world_size == 1 and config.device.device in ("auto", "cuda") and not envs.world_size() > 1


def _open_cuda(marks: dict[str, float]) -> None:
    """The CUDA context and a cuBLAS handle, in a thread while the engine code imports."""
    import torch  # noqa: PLC0415

    start = time.time()
    try:
        if torch.cuda.is_available():
            torch.cuda.init()
            torch.empty(1, device="cuda")
            torch.cuda.current_blas_handle()
            marks["cuda_start"], marks["cuda_end"] = start, time.time()
    except Exception:   # noqa: BLE001 - the engine meets the same error where it reports it
        pass


def use_bytecode_cache(root: str | None = None) -> str | None:
    """Point this process's bytecode at a writable cache folder when Python is told not to write
    `.pyc` files and torch has none (see the module docstring); returns the folder, or None."""
    import importlib.util  # noqa: PLC0415

    if not sys.dont_write_bytecode or sys.pycache_prefix or not envs.bytecode_cache_enabled():
        return None
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None or os.path.isdir(os.path.join(os.path.dirname(spec.origin), "__pycache__")):
        return None
    folder = root or str(envs.cache_home() / "tokenforge" / "bytecode")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None
    if not os.access(folder, os.W_OK):
        return None
    sys.pycache_prefix, sys.dont_write_bytecode = folder, False
    return folder


def main() -> None:
    """The child's entry (`python -c`): see the module docstring."""
    import signal  # noqa: PLC0415

    boot = time.time()
    use_bytecode_cache()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    spec = json.loads(sys.argv[1])
    sys.path[:] = spec["sys_path"] + [p for p in sys.path if p not in spec["sys_path"]]
    for fd in (spec["start_fd"], spec["life_fd"]):    # the life pipe stays open until exit: the parent's sentinel
        os.set_inheritable(fd, False)                  # the core's own children (workers) hold neither
    inbox = _Inbox(spec["start_fd"])
    marks = {"core_exec": process_start_time(), "core_boot": boot}
    default = spec["core_path"] == DEFAULT_CORE
    cuda = None
    if default:
        # The executor's allocator settings, before anything opens CUDA (engine/startup.py sets the same).
        envs.set_default("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        import torch  # noqa: F401, PLC0415 - the long pole: seconds on a GPU host

        marks["torch"] = time.time()
        if inbox.ready.is_set() and _one_gpu(inbox.config_bytes):
            cuda = threading.Thread(target=_open_cuda, args=(marks,), name="cuda-init", daemon=True)
            cuda.start()
    importlib.import_module(spec["core_path"].partition(":")[0])
    marks["engine_code"] = time.time()
    inbox.ready.wait()
    marks["config"] = inbox.received_at
    if cuda is not None:
        cuda.join()
    from tokenforge.engine.core_process import run_engine_core  # noqa: PLC0415

    header = inbox.header
    run_engine_core(inbox.config_bytes, header["input"], header["output"], spec["parent_pid"],
                    header["core_path"], header["log_level"],
                    prestarted=header.get("prestarted", False), marks=marks)
