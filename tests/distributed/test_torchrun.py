"""Two "nodes" on loopback: `torchrun --nnodes 2 -m tokenforge serve --tensor-parallel-size 2`.

Each node is its own torchrun agent with one process. Rank 0 serves HTTP (its engine core joins
the world through MASTER_ADDR/MASTER_PORT), rank 1 follows rank 0's step broadcasts over gloo.
A SIGTERM to rank 0's server drains it, rank 1 is told to stop, and both agents exit 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai

from tests.distributed.conftest import MAX_TOKENS, PROMPTS, child_pids
from tests.server.servers import REPO, free_port


def test_two_nodes_on_loopback_serve_tp2(widened_model, tp1_outputs, tmp_path):
    master, http = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": REPO}
    agents, logs = [], []
    for node in (0, 1):
        log = open(tmp_path / f"node{node}.log", "w+")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(master),
               "-m", "tokenforge", "serve", "--model", widened_model, "--tensor-parallel-size", "2",
               "--device", "cpu", "--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "64",
               "--port", str(http)]
        agents.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    try:
        url = f"http://127.0.0.1:{http}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert all(a.poll() is None for a in agents), _tail(logs)
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
        assert out.choices[0].text == tp1_outputs["text"][0]

        (server,) = child_pids(agents[0].pid)
        os.kill(server, signal.SIGTERM)
        assert [a.wait(60) for a in agents] == [0, 0], _tail(logs)
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()


def _tail(logs) -> str:
    text = []
    for log in logs:
        log.seek(0)
        text.append(log.read()[-3000:])
    return "\n-----\n".join(text)
