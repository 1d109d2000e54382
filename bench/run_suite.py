"""Run one named suite of bench/suites.toml on this (device) machine.

    python3 bench/run_suite.py NAME OUTDIR     the suite's tests, then its bench lines
    python3 bench/run_suite.py --list          every suite, its device kind and what it runs

Wheels in .whl/ are installed into /tmp/site first (the device machine has no network). Every run
gets a timeout, so one that hangs does not cost the rest of the session; its output goes to
OUTDIR/logs/NN-<kind>.log and its last lines to stdout. OUTDIR/summary.json records the commit,
the GPU, and every run's command, exit code and seconds; the results JSON are in OUTDIR/results.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUITES = REPO / "bench" / "suites.toml"
DEFAULT_LAUNCHER = "python3 -m tokenforge.bench"
DEFAULT_TIMEOUT_S = 300


def load_suites(path: Path = SUITES) -> dict[str, dict]:
    with open(path, "rb") as f:
        return tomllib.load(f)


def commands(suite: dict, out: str) -> list[tuple[str, list[str]]]:
    """(kind, argv) of every run of a suite, in order: its tests, then its bench lines."""
    runs = [("tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *shlex.split(t)])
            for t in suite.get("tests", [])]
    launcher = shlex.split(suite.get("launcher", DEFAULT_LAUNCHER))
    runs += [("bench", [*launcher, *shlex.split(line.format(out=out))]) for line in suite.get("bench", [])]
    return runs


def _environment(suite: dict) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **suite.get("env", {})}
    wheels = sorted(str(p) for p in (REPO / ".whl").glob("*.whl"))
    site = [str(REPO)]
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", "/tmp/site", *wheels], check=True)
        site.insert(0, "/tmp/site")
    env["PYTHONPATH"] = os.pathsep.join([*site, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _probe(argv: list[str]) -> str | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=REPO).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_suite(name: str, out_dir: str) -> int:
    suites = load_suites()
    if name not in suites:
        print(f"run_suite: no suite {name!r} in {SUITES.name}: {', '.join(suites)}", file=sys.stderr)
        return 2
    suite, out = suites[name], Path(out_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "results").mkdir(exist_ok=True)
    env = _environment(suite)
    summary = {"suite": name, "device": suite.get("device"), "commit": _probe(["git", "rev-parse", "HEAD"]),
               "gpu": _probe(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]), "runs": []}
    timeout = suite.get("timeout", DEFAULT_TIMEOUT_S)
    worst = 0
    for i, (kind, argv) in enumerate(commands(suite, str(out))):
        log = out / "logs" / f"{i:02d}-{kind}.log"
        print(f"=== {name} {i:02d} {kind}: {shlex.join(argv)}", flush=True)
        start = time.perf_counter()
        with open(log, "w") as f:
            try:
                rc = subprocess.run(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        seconds = round(time.perf_counter() - start, 1)
        print("".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:]), flush=True)
        print(f"--- rc {rc} in {seconds} s ({log})", flush=True)
        summary["runs"].append({"kind": kind, "command": shlex.join(argv), "rc": rc, "seconds": seconds,
                                "log": str(log.relative_to(out))})
        worst = worst or rc
    summary["results"] = sorted(str(p.relative_to(out)) for p in (out / "results").glob("*.json"))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return worst


def main(argv: list[str]) -> int:
    if argv[:1] == ["--list"]:
        for name, suite in load_suites().items():
            print(f"{name:<14} {suite.get('device', '?'):<15} {suite.get('description', '')}")
        return 0
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    return run_suite(*argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
