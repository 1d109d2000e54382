"""`tokenforge bench coldstart`: W10, process start to /health 200 for `tokenforge serve`.

In: a model config (default the Llama-3.1-8B shape). The bench writes a real safetensors
checkpoint with random weights once (`--checkpoint-dir`), then starts the server from it several
times: `cold` with empty Triton/compile caches and a fresh engine cache (and the page cache
dropped when this process may), then `warm` with that engine cache filled by the cold start.
Out: seconds to /health 200 for each, plus the engine's own start-up phase breakdown (the
"start-up:" log line of the engine core).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tokenforge import envs
from tokenforge.bench.lib import report, workloads
from tokenforge.bench.lib.checkpoint import write_random_checkpoint

_PHASES = re.compile(r"start-up: (.*)$")
# the log lines that place the phases on the clock (both processes), kept in the result
_EVENTS = re.compile(r"start-up timeline|engine core process started|imports done|config resolved|loaded .* in|KV cache ready|start-up:|"
                     r"CUDA graphs|warm-up:|tokenizer loaded|checksum|ready in|serving|Uvicorn running|WARNING|ERROR")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=workloads.DEFAULT_GPU_MODEL, help="architecture config (name or config.json)")
    p.add_argument("--checkpoint-dir", default=os.path.join(tempfile.gettempdir(), "tokenforge-w10-checkpoint"))
    p.add_argument("--cache-dir", default=None, help="engine cache used by the warm start (default: a temp dir)")
    p.add_argument("--serve-args", default="", help="extra flags for tokenforge serve, e.g. '--max-model-len 4096'")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--warm-runs", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--results-dir", default=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def time_start(checkpoint: Path, env: dict, serve_args: list[str], timeout: float) -> dict:
    """Start the server, poll /health every 20 ms, stop it; seconds and the engine's phases."""
    port = _free_port()
    cmd = [sys.executable, "-m", "tokenforge", "--log-level", "INFO", "serve", "--model", str(checkpoint),
           "--port", str(port), *serve_args]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    seconds = None
    try:
        while time.perf_counter() - t0 < timeout and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        seconds = time.perf_counter() - t0
                        break
            except OSError:
                time.sleep(0.02)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    text = Path(log.name).read_text(errors="replace")
    phases = [m.group(1) for m in map(_PHASES.search, text.splitlines()) if m]
    if seconds is None:
        print(text[-4000:], flush=True)
    started = time.strftime("%H:%M:%S", time.localtime(time.time() - (time.perf_counter() - t0)))
    events = [line[:700 if "timeline" in line else 200] for line in text.splitlines() if _EVENTS.search(line)]
    return {"seconds": seconds, "phases": phases[-1] if phases else None, "exit_code": proc.returncode,
            "started_at": started, "log": events}


def main(args: argparse.Namespace) -> dict:
    cfg = workloads.load_config_dict(args.model)
    if cfg is None:
        raise SystemExit(f"coldstart needs an architecture config, got {args.model!r}")
    result = report.new_result("W10", args.model, "bfloat16")
    ckpt = Path(args.checkpoint_dir)
    if not (ckpt / "config.json").is_file():
        import torch  # noqa: PLC0415

        t0 = time.perf_counter()
        write_random_checkpoint(cfg, ckpt, device="cuda" if torch.cuda.is_available() else "cpu")
        result["checkpoint_write_s"] = time.perf_counter() - t0
        print(f"wrote {ckpt} in {result['checkpoint_write_s']:.1f} s", flush=True)
    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="tokenforge-engine-cache-"))
    shutil.rmtree(cache, ignore_errors=True)
    serve_args = [*args.serve_args.split(), "--engine-cache-dir", str(cache)]
    env = envs.child_env(TRITON_CACHE_DIR=str(cache / "cold-triton"))
    result["page_cache_dropped"] = _drop_page_cache()
    result["cold"] = time_start(ckpt, env, serve_args, args.timeout)
    print(f"cold: {result['cold']}", flush=True)
    env = envs.child_env()
    result["warm"] = [time_start(ckpt, env, serve_args, args.timeout) for _ in range(args.warm_runs)]
    print(f"warm: {result['warm']}", flush=True)
    report.save(result, args)
    rows = [["cold", result["cold"]["seconds"], result["cold"]["phases"]]]
    rows += [["warm", w["seconds"], w["phases"]] for w in result["warm"]]
    report.print_table(f"W10 cold start  {args.model}  {result['device']}", ["start", "s to /health 200", "phases"],
                       rows)
    return result
