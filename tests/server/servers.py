"""Live servers in subprocesses, for tests that go through real sockets, signals and exit codes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess on a free port; its output goes to a temp file (shown on failure)."""

    def __init__(self, argv: list[str], *, env: dict | None = None, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile(prefix="tokenforge-server-", suffix=".log", delete=False)
        full_env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
        extra = ["--api-key", api_key] if api_key else []
        self.proc = subprocess.Popen([*argv, "--port", str(self.port), *extra], cwd=REPO, env=full_env,
                                     stdout=self.log, stderr=subprocess.STDOUT)

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)        # a refused connection or a 503 costs the starting server ~nothing
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-6000:]

    def engine_pid(self) -> int:
        """The engine-core child (engine/core_boot.py's interpreter), found through /proc."""
        for task in os.listdir(f"/proc/{self.proc.pid}/task"):
            with open(f"/proc/{self.proc.pid}/task/{task}/children") as f:
                for pid in f.read().split():
                    with open(f"/proc/{pid}/cmdline", "rb") as c:
                        if b"tokenforge.engine.core_boot" in c.read():
                            return int(pid)
        raise RuntimeError("no engine-core child process found")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def fake_server(*flags: str, env: dict | None = None, api_key: str | None = None) -> ServerProcess:
    server = ServerProcess([sys.executable, os.path.join(HERE, "fake_server.py"), *flags], env=env, api_key=api_key)
    server.wait_healthy(300)       # seconds when idle; minutes on a loaded machine
    return server
