"""`tokenforge serve` start-up failures end the process within seconds, in one line, exit != 0.

The engine-core cases use the real server and core process around the fake core (fakes.py,
TOKENFORGE_FAKE_START); the argument cases run the real CLI, which refuses them before it spawns
anything. Every case has a timeout: a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import socket
import subprocess
import sys
import time

import pytest

from tokenforge.config import EngineConfig
from tokenforge.engine.async_engine import AsyncEngine

from .fakes import START_ENV, FakeEngineCore
from .servers import HERE, REPO, free_port

ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
NOISE = ("Traceback", "Task exception was never retrieved", "usage:")


def _run(argv: list[str], env: dict | None = None, timeout: float = 60) -> tuple[int, str, float]:
    start = time.monotonic()
    out = subprocess.run(argv, cwd=REPO, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout + out.stderr, time.monotonic() - start


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if "ERROR" in line or "error:" in line]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start,message", [
    ("raise", "engine core failed to start: RuntimeError: the fake core could not load its model"),
    ("exit", "engine core process exited with code 3 during start-up"),
])
def test_an_engine_core_that_dies_before_ready_ends_serve(start, message):
    rc, output, seconds = _run([sys.executable, os.path.join(HERE, "fake_server.py"), "--port", str(free_port())],
                               env={START_ENV: start})
    assert rc == 1, output
    assert _errors(output) == [line for line in output.splitlines() if message in line], output
    assert len(_errors(output)) == 1 and not any(n in output for n in NOISE), output
    assert "serving" not in output
    assert seconds < 45, seconds


@pytest.mark.timeout(60)
def test_a_tokenizer_failure_while_the_core_loads_is_raised_at_once(tmp_path, monkeypatch):
    """The API process loads the tokenizer while the core loads the model: its failure ends the
    start-up at once (the core is stopped), rather than surfacing later as an unretrieved task."""
    monkeypatch.setenv(START_ENV, "sleep:60")
    config = EngineConfig.from_kwargs(model=str(tmp_path / "missing"), device="cpu")
    start = time.monotonic()
    with pytest.raises(ValueError, match="does not exist"):
        asyncio.run(AsyncEngine.start(config, core_path=f"{FakeEngineCore.__module__}:FakeEngineCore"))
    assert time.monotonic() - start < 30
    assert not multiprocessing.active_children()


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "tokenforge.cli", *argv]


@pytest.mark.timeout(60)
def test_a_port_in_use_is_refused_before_anything_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, output, _ = _run(_cli("serve", "--port", str(port)))
    assert rc == 1
    assert output.strip() == f"tokenforge: error: cannot listen on 127.0.0.1:{port}: Address already in use"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv,rc,needle", [
    (["serve", "/no/such/model"], 2, "model path '/no/such/model' does not exist"),
    (["serve", "--device", "cuda"], 2, "device 'cuda' is not available"),
])
def test_bad_serve_arguments_are_one_line(argv, rc, needle):
    if "cuda" in argv:
        pytest.importorskip("torch").cuda.is_available() and pytest.skip("this machine has CUDA")
    code, output, _ = _run(_cli(*argv, "--port", str(free_port())))
    assert code == rc, output
    assert output.strip().splitlines() == [f"tokenforge: error: {output.split('error: ', 1)[1].strip()}"]
    assert needle in output and not any(n in output for n in NOISE)
