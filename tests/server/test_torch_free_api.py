"""`tokenforge serve`'s API process imports no torch and opens no CUDA context: the device, the
batch limits and the fit check are the engine core's (engine/startup.py), and the API takes the
resolved config from the core's Ready.

The real CLI path (main(["serve", ...])) runs around the fake core (fakes.py), which resolves
nothing itself: what the API process serves with (the context length in the 400, the batch limit
of its admission) can only have come from the core.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .servers import HERE, REPO, free_port

ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.timeout(300)
def test_the_api_process_serves_without_importing_torch(tmp_path):
    report = tmp_path / "report.json"
    # Device auto on purpose: resolving it is what imported torch (and probed CUDA) in this process.
    argv = [sys.executable, os.path.join(HERE, "torch_free_serve.py"), str(report), "--port", str(free_port()),
            "--served-model-name", "m"]
    out = subprocess.run(argv, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(report.read_text())
    assert result["torch_modules"] == [], result["torch_modules"][:10]
    # a prompt of 300 token ids; the fake core resolved a context of 256
    status, body = result["long"]
    assert status == 400, body
    assert "max_model_len is 256" in body["error"]["message"] and "tokens long" in body["error"]["message"], body
    status, body = result["short"]
    assert status == 200 and body["choices"][0]["text"], body
    assert "config resolved in" in out.stderr        # the core's line, once it accepted the config
