"""Results files and the printed tables of the benchmarks.

In: a result dict built by a bench. Out: `<results-dir>/<YYYY-MM-DD>-<device>-<workload>.json`
(and a copy in `--out`), holding the command, the commit, the device and the ceilings beside the
figures, and a short fixed-width table printed last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from tokenforge import envs

DEFAULT_RESULTS_DIR = "."   # a user's run never overwrites the committed records in bench/results


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return _cpu_model() or platform.processor() or "CPU"


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def device_short(name: str | None = None) -> str:
    """'NVIDIA H200' -> 'h200'; any CPU -> 'cpu'."""
    if not torch.cuda.is_available() and name is None:
        return "cpu"
    name = name or device_name()
    m = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Za-z]*)\b", name)
    return m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def git_commit() -> dict:
    """The measured code's commit and whether tracked files differ from it."""
    env = envs.commit()
    if env:            # said by the caller: a tree copied under another checkout finds that one's git
        return {"commit": env, "dirty": None}
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], capture_output=True, timeout=10,
                               check=False).returncode != 0
        return {"commit": sha, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None}


def new_result(workload: str, model: str | None, dtype: str) -> dict:
    return {
        "workload": workload,
        "model": model or "smollm2-135m-instruct",
        "dtype": dtype,
        "device": device_name(),
        **git_commit(),
        "command": command_line(),
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
    }


def command_line() -> str:
    """The command as a user would type it again."""
    program = Path(sys.argv[0]).name
    if program == "tokenforge":
        return " ".join(["tokenforge", *sys.argv[1:]])
    if program == "__main__.py" and "bench" in Path(sys.argv[0]).parent.name:
        return " ".join(["python -m tokenforge.bench", *sys.argv[1:]])
    return " ".join(sys.argv)


def result_filename(result: dict) -> str:
    date = result["date"][:10]
    variant = f"-{result['variant']}" if result.get("variant") else ""
    return f"{date}-{device_short()}-{result['workload']}{variant}.json"


def save(result: dict, args: argparse.Namespace) -> list[Path]:
    """Write the result JSON to the results folder and copy it to `--out`; returns the paths."""
    if getattr(args, "resolved_engine", None):
        result.setdefault("engine", args.resolved_engine)
    results_dir = Path(getattr(args, "results_dir", None) or DEFAULT_RESULTS_DIR)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / result_filename(result)
    path.write_text(json.dumps(result, indent=2, default=_jsonable) + "\n")
    paths = [path]
    out = getattr(args, "out", None)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        dest = Path(out) / path.name
        if dest.resolve() != path.resolve():
            shutil.copyfile(path, dest)
            paths.append(dest)
    print(f"results: {', '.join(str(p) for p in paths)}")
    return paths


def copy_artifact(path: Path, args: argparse.Namespace) -> list[Path]:
    """Put an extra file (a plot) beside the results, in the results folder and in `--out`."""
    paths = [path]
    for folder in (getattr(args, "results_dir", None) or DEFAULT_RESULTS_DIR, getattr(args, "out", None)):
        if folder and Path(folder).resolve() != path.parent.resolve():
            Path(folder).mkdir(parents=True, exist_ok=True)
            paths.append(Path(shutil.copy(path, Path(folder) / path.name)))
    return paths


def _jsonable(value):
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def fmt(value, digits: int = 1) -> str:
    """Numbers for the table: thousands separators, fixed decimals, '-' for missing."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}" if abs(value) >= 10 else f"{value:.3g}"
    return str(value)


def print_table(title: str, headers: list[str], rows: list[list], file=None) -> str:
    cells = [[str(c) for c in headers]] + [[c if isinstance(c, str) else fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    text = "\n".join([f"== {title}", line(cells[0]), "  ".join("-" * w for w in widths), *map(line, cells[1:])])
    print(text, file=file or sys.stdout, flush=True)
    return text
