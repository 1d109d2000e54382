"""Every ```bash and ```python block of README.md runs, on the bundled model, so the README
cannot rot.

A block is skipped only when the line just before its fence is
`<!-- readme-test: skip (reason) -->`, with a reason (needs a GPU, starts a server, ...).
The python blocks run in order in one process that shares one model load between them (LLM is
memoized by its arguments); the bash blocks run from the repository root, each under bash -e
with a timeout.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SKIP = re.compile(r"<!-- readme-test: skip \((?P<reason>.*\S.*)\) -->")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

# Runs the python blocks given on stdin (as [[line, code], ...]) in order; one LLM per arguments.
_PYTHON_DRIVER = r"""
import json, sys, traceback
import tokenforge
from tokenforge.engine.llm import LLM

_shared = {}

def shared_llm(*args, **kwargs):
    key = repr((args, sorted(kwargs.items())))
    if key not in _shared:
        _shared[key] = LLM(*args, **kwargs)
    return _shared[key]

tokenforge.LLM = shared_llm
for line, code in json.load(sys.stdin):
    print(f"--- README.md python block at line {line}", flush=True)
    try:
        exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})
    except BaseException:
        traceback.print_exc()
        sys.exit(f"README.md python block at line {line} failed")
"""


@dataclass(frozen=True)
class Block:
    lang: str
    line: int             # 1-based line of the opening fence
    code: str
    skip_reason: str | None


def readme_blocks(text: str) -> list[Block]:
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        skip = SKIP.fullmatch(lines[i - 1].strip()) if i else None
        blocks.append(Block(fence["lang"], i + 1, "\n".join(lines[i + 1:end]) + "\n",
                            skip["reason"].strip() if skip else None))
        i = end + 1
    return blocks


def _runnable(lang: str) -> list[Block]:
    return [b for b in readme_blocks(README.read_text()) if b.lang == lang and b.skip_reason is None]


def test_the_parser_reads_fences_and_skip_marks():
    text = ("intro\n```bash\necho one\n```\n<!-- readme-test: skip (needs a GPU) -->\n```python\nx = 1\n```\n"
            "<!-- readme-test: skip () -->\n```bash\necho two\n```\n")
    blocks = readme_blocks(text)
    assert [(b.lang, b.line, b.skip_reason) for b in blocks] == [
        ("bash", 2, None), ("python", 6, "needs a GPU"), ("bash", 10, None)]   # an empty reason is no mark
    assert blocks[0].code == "echo one\n"


def test_every_skipped_block_says_why():
    blocks = readme_blocks(README.read_text())
    assert _runnable("bash") and _runnable("python"), "the README test would test nothing"
    for block in blocks:
        assert block.lang in ("bash", "python", "text", ""), f"README.md:{block.line}: unknown fence {block.lang!r}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_python_blocks_run():
    blocks = [[b.line, b.code] for b in _runnable("python")]
    out = subprocess.run([sys.executable, "-c", _PYTHON_DRIVER], input=json.dumps(blocks), cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", _runnable("bash"), ids=lambda b: f"line{b.line}")
def test_readme_bash_block_runs(block: Block):
    out = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.code], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=540)   # a bound on hangs: ~20 s when quiet
    assert out.returncode == 0, f"README.md:{block.line}\n{block.code}\n{out.stdout[-3000:]}{out.stderr[-5000:]}"
