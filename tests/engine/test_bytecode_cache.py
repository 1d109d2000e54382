"""The core's bytecode cache (engine/core_boot.use_bytecode_cache): with PYTHONDONTWRITEBYTECODE=1
and a torch installed without `.pyc` files, the core keeps its bytecode under the cache folder, so
the second start reads what the first compiled; everywhere else Python's own rules stand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
from tokenforge.engine.core_boot import use_bytecode_cache
folder = use_bytecode_cache(sys.argv[1])
import torch
print(json.dumps({"folder": folder, "prefix": sys.pycache_prefix, "dont_write": sys.dont_write_bytecode,
                  "torch": torch.__file__, "cached": getattr(torch, "__cached__", None)}))
"""


def _probe(tmp_path: Path, fake_torch: bool, **env: str) -> dict:
    site = tmp_path / "site"
    source = site / "torch" / "__init__.py"
    if fake_torch and not source.exists():   # a torch without __pycache__, as a no-bytecode install leaves it
        source.parent.mkdir(parents=True)      # (written once: a rewritten source invalidates its .pyc)
        source.write_text("VALUE = 1\n")
    path = os.pathsep.join([str(site), str(ROOT)]) if fake_torch else str(ROOT)
    full_env = {**os.environ, "PYTHONPATH": path, **env}
    full_env.pop("PYTHONPYCACHEPREFIX", None)
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "bytecode")], env=full_env,
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_no_bytecode_install_gets_a_cache_folder_and_the_second_start_reads_it(tmp_path):
    first = _probe(tmp_path, True, PYTHONDONTWRITEBYTECODE="1")
    folder = str(tmp_path / "bytecode")
    assert first["folder"] == folder and first["prefix"] == folder and first["dont_write"] is False
    assert first["cached"].startswith(folder)
    cached = Path(first["cached"])
    assert cached.is_file()                                       # the first start wrote torch's bytecode there
    mtime = cached.stat().st_mtime_ns
    time.sleep(1.1)                    # a later second, as a later start is (mtimes are kept in seconds)
    second = _probe(tmp_path, True, PYTHONDONTWRITEBYTECODE="1")
    assert second["cached"] == first["cached"] and cached.stat().st_mtime_ns == mtime   # read, not rewritten
    assert not (tmp_path / "site" / "torch" / "__pycache__").exists()                    # nothing beside the sources


def test_python_rules_stand_elsewhere(tmp_path):
    off = _probe(tmp_path, True, PYTHONDONTWRITEBYTECODE="1", TOKENFORGE_BYTECODE_CACHE="0")
    assert off["folder"] is None and off["prefix"] is None and off["dont_write"] is True
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    writes = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "b2")], capture_output=True, text=True,
                            env={**env, "PYTHONPATH": str(ROOT)}, timeout=120, check=True)
    assert json.loads(writes.stdout.strip().splitlines()[-1])["folder"] is None    # Python writes .pyc itself
    shipped = _probe(tmp_path, False, PYTHONDONTWRITEBYTECODE="1")                  # the real torch ships .pyc
    assert shipped["folder"] is None and shipped["prefix"] is None
