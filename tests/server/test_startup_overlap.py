"""`tokenforge serve` starts the engine core at the command's first statement (engine/core_boot.py):
the core imports torch while the API process imports the CLI and the server; and no core outlives
its API process, however that ends.

Overlap is asserted on the start-up timeline line's own marks (both processes on one clock), not
on durations, so load on the machine cannot break it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from .servers import REPO, free_port

ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _serve(port: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "tokenforge", "--log-level", "info", "serve", "--model", "tiny-llama",
            "--load-format", "dummy", "--device", "cpu", "--port", str(port)]
    return subprocess.Popen(argv, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            return "\nState:\tZ" in f.read()        # a zombie has exited (its reaper is not ours)
    except OSError:
        return True


def _spans(text: str) -> dict[str, tuple[float, float]]:
    """'name a-b' parts of one side of the timeline line -> {name: (a, b)}."""
    return {m[0].strip(): (float(m[1]), float(m[2])) for m in re.findall(r"([a-z_ ]+?) (\d+\.\d\d)-(\d+\.\d\d)", text)}


def _wait(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_core_imports_while_the_api_imports_and_stops_with_it():
    port = free_port()
    proc = _serve(port)
    try:
        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return proc.poll() is not None
        assert _wait(healthy, 240) and proc.poll() is None
        core = _children(proc.pid)
        assert len(core) == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output
    line = next(line for line in output.splitlines() if "start-up timeline:" in line)
    api, core_part = line.split("| api: ", 1)[1].split(" | core: ")
    api_marks, core_marks = _spans(api), _spans(core_part)
    assert "imports" in api_marks and "torch" in core_marks, line
    # the core was spawned before the API process had imported its CLI and parsed the flags, and it
    # was importing torch while the API imported its server (not after: the API's imports can end
    # before a fresh interpreter has even started, so torch's start is compared with the server's)
    spawned = re.search(r"core: spawned (\d+\.\d\d)", line)
    assert spawned and float(spawned[1]) < api_marks["imports"][1], line
    assert core_marks["torch"][0] < api_marks["server imports"][1], line
    # and the API imported the HTTP server while the core was still importing
    assert api_marks["server imports"][0] < core_marks["engine code"][1], line
    for name in ("load", "kv_cache", "resolve"):
        assert name in core_marks, line
    assert _wait(lambda: _gone(core[0]), 30)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_api_process_leaves_no_engine_core():
    """SIGKILL, the one exit no handler sees: the core, still importing, exits on its start pipe."""
    proc = _serve(free_port())
    try:
        assert _wait(lambda: bool(_children(proc.pid)), 30)
        core = _children(proc.pid)[0]
        proc.kill()
        proc.wait(30)
        assert _wait(lambda: _gone(core), 30), f"engine core {core} outlived its API process"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
