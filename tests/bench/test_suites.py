"""bench/suites.toml: every suite names a device kind, test paths that exist, and bench lines that
the real `tokenforge bench` parser accepts (so a device session never dies on a typo)."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

import pytest

from tokenforge.bench import BENCHES
from tokenforge.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("run_suite", REPO / "bench" / "run_suite.py")
run_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_suite)
SUITES = run_suite.load_suites()
DEVICE_KINDS = {"nvidia-h200", "nvidia-h200-x2", "nvidia-h200-x4", "nvidia-h200-x8"}


def test_the_suites_replace_the_dated_scripts():
    assert {"regression", "gpu-tests", "kernels"} <= set(SUITES)
    assert not (REPO / "bench" / "gpu").exists() and not (REPO / "bench" / "gpu_session.sh").exists()


@pytest.mark.parametrize("name", sorted(SUITES))
def test_a_suite_says_where_it_runs_and_what(name):
    suite = SUITES[name]
    assert suite["device"] in DEVICE_KINDS and suite["description"]
    assert suite["tests"] or suite["bench"]
    for line in suite["tests"]:
        paths = [a.split("::")[0] for a in shlex.split(line) if not a.startswith("-") and a != "gpu"]
        assert paths and all((REPO / p).exists() for p in paths), (name, line)


@pytest.mark.parametrize("name,line", [(n, line) for n in sorted(SUITES) for line in SUITES[n]["bench"]])
def test_every_bench_line_parses(name, line, tmp_path):
    argv = shlex.split(line.format(out=str(tmp_path)))
    assert argv[0] in BENCHES, (name, argv[0])
    args = build_parser(["bench", argv[0]]).parse_args(["bench", *argv])
    assert callable(args.func)


def test_the_runner_builds_the_commands(tmp_path):
    runs = run_suite.commands(SUITES["train-x2"], str(tmp_path))
    assert [kind for kind, _ in runs] == ["bench", "bench"]
    assert runs[0][1][:5] == ["torchrun", "--standalone", "--nproc-per-node", "2", "-m"]
    assert f"{tmp_path}/results" in runs[0][1]
    (kind, argv), = run_suite.commands(SUITES["gpu-tests"], str(tmp_path))
    assert kind == "tests" and argv[1:3] == ["-m", "pytest"] and "tests/kernels" in argv
