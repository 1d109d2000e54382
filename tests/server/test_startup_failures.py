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

from .fakes import START_ENV, FakeEngineCore, FakeTokenizer
from .servers import HERE, REPO, free_port

ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
NOISE = ("Traceback", "Task exception was never retrieved", "usage:")


def _run(argv: list[str], env: dict | None = None, timeout: float = 60) -> tuple[int, str, float]:
    start = time.monotonic()
    out = subprocess.run(argv, cwd=REPO, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout + out.stderr, time.monotonic() - start


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if "ERROR" in line or "error:" in line]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("start,message", [
    ("raise", "engine core failed to start: RuntimeError: the fake core could not load its model"),
    ("exit", "engine core process exited with code 3 during start-up"),
])
def test_an_engine_core_that_dies_before_ready_ends_serve(start, message):
    rc, output, seconds = _run([sys.executable, os.path.join(HERE, "fake_server.py"), "--port", str(free_port())],
                               env={START_ENV: start}, timeout=240)
    assert rc == 1, output
    assert _errors(output) == [line for line in output.splitlines() if message in line], output
    assert len(_errors(output)) == 1 and not any(n in output for n in NOISE), output
    assert "serving" not in output
    assert seconds < 180, seconds      # seconds when idle; the bound only catches a hang, on any load


@pytest.mark.timeout(300)
def test_a_tokenizer_failure_while_the_core_loads_is_raised_at_once(tmp_path, monkeypatch):
    """The API process loads the tokenizer while the core loads the model: its failure ends the
    start-up at once (the core is stopped), rather than surfacing later as an unretrieved task."""
    monkeypatch.setenv(START_ENV, "sleep:600")      # far beyond the bound below, so waiting for it fails
    config = EngineConfig.from_kwargs(model=str(tmp_path / "missing"), device="cpu")
    start = time.monotonic()
    with pytest.raises(ValueError, match="does not exist"):
        asyncio.run(AsyncEngine.start(config, core_path=f"{FakeEngineCore.__module__}:FakeEngineCore"))
    assert time.monotonic() - start < 150
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
    (["serve", "--override-generation-config", '{"temprature": 0.5}'], 2,
     "--override-generation-config: unknown key(s) 'temprature'"),
    (["serve", "--generation-config", "/no/such/dir"], 2, "--generation-config /no/such/dir: no generation_config.json"),
])
def test_bad_serve_arguments_are_one_line(argv, rc, needle):
    if "cuda" in argv:
        pytest.importorskip("torch").cuda.is_available() and pytest.skip("this machine has CUDA")
    code, output, _ = _run(_cli(*argv, "--port", str(free_port())))
    assert code == rc, output
    assert output.strip().splitlines() == [f"tokenforge: error: {output.split('error: ', 1)[1].strip()}"]
    assert needle in output and not any(n in output for n in NOISE)


FAKE_CORE = f"{FakeEngineCore.__module__}:FakeEngineCore"


@pytest.mark.timeout(90)
def test_a_prestarted_core_is_configured_later_or_stopped_unconfigured(tmp_path, monkeypatch):
    """`serve` starts the core before its config is resolved (the core imports meanwhile), then
    hands the config over; a core that never gets one (a bad flag) is stopped without a trace."""
    from tokenforge.engine.core_client import EngineCoreClient

    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])       # the child imports the fake core
    idle = EngineCoreClient.prestart(FAKE_CORE)
    assert idle.process.is_alive()
    idle.shutdown()
    assert not idle.process.is_alive() and not multiprocessing.active_children()
    with pytest.raises(RuntimeError, match="prestart"):
        EngineCoreClient(EngineConfig.from_kwargs(device="cpu"), core_path=FAKE_CORE).configure(
            EngineConfig.from_kwargs(device="cpu"))

    async def serve_one() -> int:
        config = EngineConfig.from_kwargs(device="cpu", load_format="dummy", model="tiny-llama", num_kv_blocks=48)
        engine = await AsyncEngine.start(config, client=EngineCoreClient.prestart(FAKE_CORE), tokenizer=FakeTokenizer())
        try:
            return engine.runtime.num_kv_blocks
        finally:
            await engine.shutdown()

    assert asyncio.run(serve_one()) == 48
    assert not multiprocessing.active_children()


@pytest.mark.timeout(60)
def test_a_bad_flag_leaves_no_engine_core_behind():
    code, output, _ = _run(_cli("--log-level", "debug", "serve", "/no/such/model", "--port", str(free_port())))
    assert code == 2, output
    pid = int(output.split("engine core process started (pid ", 1)[1].split(")", 1)[0])
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
