"""`tokenforge serve` as the CLI runs it (main(["serve", ...])), around the fake core, reporting
what the API process imported: `python torch_free_serve.py REPORT.json [serve flags]`.

Once /health answers 200 a thread records whether torch (and torch.cuda) is in this process's
sys.modules, sends a prompt longer than the context the core resolved and a short one, writes
the report and stops the server with SIGTERM, as an operator would.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(_HERE))]      # the repo root: tests.server.fakes

from tests.server.fakes import FakeEngineCore  # noqa: E402
from tokenforge.cli.main import main  # noqa: E402
from tokenforge.engine.core_client import EngineCoreClient  # noqa: E402

FAKE_CORE = f"{FakeEngineCore.__module__}:FakeEngineCore"
_prestart = EngineCoreClient.prestart.__func__
EngineCoreClient.prestart = classmethod(lambda cls, core_path=None: _prestart(cls, FAKE_CORE))


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _probe(report: str, port: int) -> None:
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as response:
                if response.status == 200:
                    break
        except OSError:
            time.sleep(0.1)
    modules = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    long_status, long_body = _post(base + "/v1/completions", {"model": "m", "prompt": [65] * 300, "max_tokens": 2})
    # ids inside the fake core's byte vocabulary (the API's tokenizer is the bundled model's, whose
    # ids for "hi" the core's vocabulary check refuses)
    short_status, short_body = _post(base + "/v1/completions", {"model": "m", "prompt": [104, 105], "max_tokens": 2})
    with open(report, "w", encoding="utf-8") as f:
        json.dump({"torch_modules": modules, "long": [long_status, long_body], "short": [short_status, short_body]}, f)
    os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    report_path, flags = sys.argv[1], sys.argv[2:]
    port = int(flags[flags.index("--port") + 1])
    threading.Thread(target=_probe, args=(report_path, port), daemon=True).start()
    sys.exit(main(["serve", *flags]))
