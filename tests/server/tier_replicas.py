"""Helpers for the KV-tier tests with real `tokenforge serve` replicas sharing a Redis."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

import httpx

from .servers import ServerProcess, free_port

# 256 blocks of 16 tokens: room for the 1,500-token prompts, and 190 MB of KV rather than the CPU default 1 GiB.
# float32 (the reference path): a restored prefix must give the cold run's tokens exactly; with the
# GGUF-native 8-bit activations a KV computed in another chunking can round differently.
SERVE = [sys.executable, "-m", "tokenforge.cli", "serve", "--device", "cpu", "--max-model-len", "2048",
         "--num-kv-blocks", "256", "--dtype", "float32"]


def start_replicas(remote_url: str, n: int = 2, *flags: str) -> list[ServerProcess]:
    """n replicas started together (their model loads overlap), with default tier flags: a remote
    tier writes through by default."""
    servers = [ServerProcess([*SERVE, "--kv-remote", remote_url, *flags])
               for _ in range(n)]
    try:
        for s in servers:
            s.wait_healthy(600)
    except Exception:
        for s in servers:
            s.stop()
        raise
    return servers


def serve_pair(remote_url: str):
    """A module fixture's body: two replicas sharing `remote_url`, stopped afterwards."""
    servers = start_replicas(remote_url)
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()


class RedisProcess:
    """A private redis-server on a free loopback port, for tests that kill it."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed (.ci/redis.sh installs it)"
        self.binary, self.port = binary, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--maxmemory-policy", "volatile-lru"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        self.proc.kill()          # SIGKILL
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()


def model_id(server: ServerProcess) -> str:
    return httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def complete(server: ServerProcess, prompt: list[int], max_tokens: int = 8, **extra) -> tuple[str, float]:
    """Greedy streamed completion: (text, seconds to the first streamed token)."""
    text, ttft, _ = stream_completion(server, prompt, max_tokens, **extra)
    return text, ttft


def stream_completion(server: ServerProcess, prompt: list[int], max_tokens: int = 8,
                      **extra) -> tuple[str, float, dict]:
    """Greedy streamed completion: (text, seconds to the first streamed token, its usage: the
    last chunk's, with `prompt_tokens_details.cached_tokens` when the engine skipped any)."""
    body = {"model": model_id(server), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    start, ttft, text, usage = time.perf_counter(), None, [], None
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=600) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            if not chunk["choices"]:
                continue
            piece = chunk["choices"][0]["text"]
            if piece and ttft is None:
                ttft = time.perf_counter() - start
            text.append(piece)
    assert usage is not None, "no usage chunk (stream_options.include_usage)"
    return "".join(text), ttft, usage


def cached_tokens(usage: dict) -> int:
    """Prompt tokens the engine did not compute: prefix-cache and KV-tier hits."""
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def metric_sum(server: ServerProcess, name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include `labels` (0 when absent)."""
    total = 0.0
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for m in re.finditer(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", text, re.MULTILINE):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def wait_for_metric(server: ServerProcess, name: str, at_least: float, timeout: float = 30, **labels) -> float:
    deadline = time.monotonic() + timeout
    while True:
        value = metric_sum(server, name, **labels)
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def check_shared_prefix(a: ServerProcess, b: ServerProcess, seed: int, prefix_len: int = 1500) -> dict:
    """The issue's mechanism: A serves a prompt it never saw, computing every token of it, and
    writes its full blocks through to Redis; B then serves the same prompt from A's blocks instead
    of computing them (what makes its TTFT the target's 3x+ shorter), with A's output.

    Asserted with the engines' own counters, not wall time (a loaded host slows both sides): A's
    `cached_tokens` is 0 and its remote puts cover every full block; B's restored-token counter
    grows by those blocks, and its `cached_tokens` (the tokens it did not compute: its first
    scheduled position) covers them too, so B computed at most the unaligned tail (+ a block)."""
    rng = random.Random(seed)
    complete(a, random_ids(rng, 40), 2)        # warm both replicas' first-request paths
    complete(b, random_ids(rng, 40), 2)
    prompt = random_ids(rng, prefix_len + 12)
    full = len(prompt) // 16
    puts0 = metric_sum(a, "tokenforge:kv_tier_puts_total", tier="remote")
    restored0 = metric_sum(b, "tokenforge:kv_tier_restored_tokens_total")
    text_cold, _, usage_cold = stream_completion(a, prompt)
    assert usage_cold["prompt_tokens"] == len(prompt) and cached_tokens(usage_cold) == 0, usage_cold   # A computed all
    puts = wait_for_metric(a, "tokenforge:kv_tier_puts_total", puts0 + full, tier="remote") - puts0
    assert puts >= full, f"A wrote {puts} of {full} blocks through to Redis"
    assert metric_sum(b, "tokenforge:kv_tier_restored_tokens_total") == restored0     # B restores nothing unasked
    text_hit, _, usage_hit = stream_completion(b, prompt)
    restored = metric_sum(b, "tokenforge:kv_tier_restored_tokens_total") - restored0
    r = {"full_blocks": full, "restored": restored, "cached_hit": cached_tokens(usage_hit), "usage_hit": usage_hit,
         "remote_hits": metric_sum(b, "tokenforge:kv_tier_hits_total", tier="remote")}
    assert restored >= (full - 1) * 16, r                               # B restored A's blocks from Redis
    assert cached_tokens(usage_hit) >= (full - 1) * 16, r               # ... and did not compute them
    assert usage_hit["prompt_tokens"] - cached_tokens(usage_hit) <= len(prompt) - (full - 1) * 16, r
    assert text_hit == text_cold, (text_hit, text_cold)                 # token-identical to the cold run
    return r


def nonce() -> int:
    return os.getpid() * 1_000_003 + time.time_ns() % 1_000_000_007
