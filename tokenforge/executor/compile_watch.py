"""Compiles after start-up: counted, and each one logged with what it compiled.

A request should never wait for the engine's JIT: every kernel configuration it can need is
compiled while the engine starts (CUDA graph capture, then `ModelRunner.warm_up`'s varied
batches), or comes from the engine cache's Triton cache. The watch makes a miss visible: Triton's
post-compile hook (process-wide) reports every compile; other builders (a C++ extension built on
first use) call `note`. Before `mark_ready` they are counted as start-up work; after it each is a
warning naming the kernel and its specialisation, and `compiles_after_ready` (EngineStats,
`tokenforge:jit_compiles_after_ready` in /metrics) grows.

One watch per process (`WATCH`): the hooks are process-wide, and an engine core is one process.
"""

from __future__ import annotations

import contextlib
import logging
import threading

logger = logging.getLogger(__name__)


class CompileWatch:
    def __init__(self) -> None:
        self.ready = False
        self.before_ready = 0
        self.after_ready: list[str] = []        # what compiled after start-up, in order
        self.off_path = 0       # compiles after Ready by start-up work no request waits for (deferred graphs)
        self._background = False
        self._lock = threading.Lock()
        self._triton_installed = False

    @property
    def compiles_after_ready(self) -> int:
        return len(self.after_ready)

    def note(self, kind: str, what: str) -> None:
        with self._lock:
            if not self.ready:
                self.before_ready += 1
                return
            if self._background:
                self.off_path += 1
                return
            self.after_ready.append(f"{kind}: {what}")
        logger.warning("%s compiled after start-up (a request waited for it): %s", kind, what)

    def mark_ready(self) -> None:
        with self._lock:
            self.ready = True
        logger.info("start-up compiled %d kernel configurations", self.before_ready)

    @contextlib.contextmanager
    def off_request_path(self):
        """Start-up work finished after Ready while the engine is idle (the deferred CUDA graphs):
        what it compiles is counted in `off_path`, not as a compile a request waited for."""
        self._background = True
        try:
            yield
        finally:
            self._background = False

    def reset(self) -> None:
        """A new engine in this process starts a new start-up (tests build several)."""
        with self._lock:
            self.ready, self.before_ready, self.after_ready, self.off_path = False, 0, [], 0

    def install_triton_hook(self) -> bool:
        """Chain onto Triton's post-compile hook (Triton >= 3.4 `knobs`, else the JITFunction
        class attribute). False when Triton is absent or has neither."""
        if self._triton_installed:
            return True
        try:
            import triton  # noqa: PLC0415
        except ImportError:
            return False
        knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
        holder, attr = (knobs, "jit_post_compile_hook") if knobs is not None and hasattr(knobs, "jit_post_compile_hook") \
            else (getattr(getattr(triton, "runtime", None), "JITFunction", None), "compiled_hook")
        if holder is None or not hasattr(holder, attr):
            return False
        previous = getattr(holder, attr)

        def hook(*args, **kwargs):
            self.note("triton", describe_compile(kwargs)[:600])
            return previous(*args, **kwargs) if previous is not None else None

        setattr(holder, attr, hook)
        self._triton_installed = True
        return True


def describe_compile(kwargs: dict) -> str:
    """A Triton compile as `kernel[constexprs](scalar args' types)`, from the post-compile hook's
    keyword arguments (Triton 3.6: `fn`, the `compile` dict with `constants` keyed by argument
    index paths and `signature` by name); else its `repr` (whose argument list Triton 3.6 leaves
    empty), else its key."""
    info, compile_ = kwargs.get("fn"), kwargs.get("compile")
    names = getattr(getattr(info, "jit_function", None), "arg_names", None)
    if isinstance(compile_, dict) and isinstance(compile_.get("constants"), dict) and names:
        def name(path):
            index = path[0] if isinstance(path, tuple) and path else path
            return names[index] if isinstance(index, int) and index < len(names) else str(path)
        consts = ", ".join(f"{name(k)}={v}" for k, v in compile_["constants"].items())
        scalars = ", ".join(f"{k}: {v}" for k, v in (compile_.get("signature") or {}).items()
                            if isinstance(v, str) and not v.startswith("*") and v != "constexpr")
        opts = f"num_warps={compile_.get('num_warps')}, num_stages={compile_.get('num_stages')}"
        return f"{getattr(info, 'name', 'a kernel')}[{consts}; {opts}]({scalars})"
    return " ".join(str(kwargs.get("repr") or kwargs.get("key") or "a kernel").split())


WATCH = CompileWatch()
