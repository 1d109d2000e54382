"""The router's `/ui` pages and `GET /ui/api/stats`: the dashboard over its replicas.

The same package assets as the server's (tokenforge/webui); the page sees `"kind": "router"` and
draws the replicas: state (admitted, ejected, version_mismatch) and why, health, load (queue
depth, running, KV usage, requests in flight), ejections and re-admissions, and prefix affinity
(how many requests went to the replica their prompt's prefix hashes to, against those moved by
load). The numbers are the router's /metrics and /router/replicas, sampled every `interval` s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from urllib.parse import parse_qs

from tokenforge.router.metrics import RouterMetrics
from tokenforge.router.replicas import ReplicaPool
from tokenforge.router.settings import RouterSettings
from tokenforge.webui import STATS_PATH, Assets


def _by_labels(metric, *names: str) -> dict[tuple, float]:
    return {tuple(s.labels[n] for n in names): s.value for family in metric.collect() for s in family.samples
            if s.name.endswith("_total")}


class RouterUI:
    def __init__(self, settings: RouterSettings, pool: ReplicaPool, metrics: RouterMetrics,
                 interval: float = 1.0, keep_s: float = 600.0) -> None:
        self.settings = settings
        self.pool = pool
        self.metrics = metrics
        self.interval = interval
        self.assets = Assets()
        self.samples: deque[dict] = deque(maxlen=int(keep_s / interval) + 1)
        self.started = time.time()
        self._last_requests: tuple[float, dict[str, float]] | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="ui-stats-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            self.record()
            await asyncio.sleep(self.interval)

    def record(self, now: float | None = None) -> dict:
        now = time.time() if now is None else now
        requests: dict[str, float] = {}
        for (replica, _), value in _by_labels(self.metrics.requests, "replica", "reason").items():
            requests[replica] = requests.get(replica, 0.0) + value
        rates = {}
        if self._last_requests is not None:
            then, before = self._last_requests
            dt = now - then
            rates = {url: round(max(0.0, n - before.get(url, 0.0)) / dt, 3) if dt > 0 else 0.0
                     for url, n in requests.items()}
        self._last_requests = (now, requests)
        row = {"t": round(now, 3), "replicas": {
            r.url: {"waiting": r.waiting, "running": r.running, "kv_usage": r.kv_usage, "in_flight": r.in_flight,
                    "admitted": r.admitted, "rps": rates.get(r.url, 0.0)} for r in self.pool.replicas.values()}}
        self.samples.append(row)
        return row

    def body(self, since: float = 0.0) -> dict:
        requests = _by_labels(self.metrics.requests, "replica", "reason")
        events = _by_labels(self.metrics.events, "replica", "event")
        replicas = []
        for r in self.pool.replicas.values():
            reasons = {reason: n for (url, reason), n in requests.items() if url == r.url}
            replicas.append({"url": r.url, "state": r.state, "reason": r.reason, "healthy": r.healthy,
                             "failures": r.failures, "waiting": r.waiting, "running": r.running,
                             "kv_usage": r.kv_usage, "in_flight": r.in_flight, "model": r.model_name,
                             "version": r.version, "checksum": r.checksum, "requests": reasons,
                             "events": {event: n for (url, event), n in events.items() if url == r.url}})
        s = self.settings
        info = {"policy": s.policy, "prefix_blocks": s.prefix_blocks, "block_size": s.block_size,
                "overload_waiting": s.overload_waiting, "health_interval": s.health_interval,
                "eject_after": s.eject_after, "retries": s.retries, "started": self.started,
                "uptime_s": round(time.time() - self.started, 1), "api_keys": len(s.api_keys)}
        return {"kind": "router", "interval": self.interval, "info": info, "replicas": replicas,
                "failed": {k[0]: v for k, v in _by_labels(self.metrics.failed, "kind").items()},
                "retries": {k[0]: v for k, v in _by_labels(self.metrics.retries, "cause").items()},
                "samples": [row for row in self.samples if row["t"] > since]}

    async def __call__(self, scope, receive, send) -> None:
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if path == STATS_PATH:
            if not self.samples:
                self.record()
            since = parse_qs(scope.get("query_string", b"").decode()).get("since", ["0"])[0]
            try:
                body = self.body(float(since))
            except ValueError:
                await _send(send, 400, _error(f"since must be a number, got {since!r}"), {})
                return
            await _send(send, 200, json.dumps(body).encode(), {"content-type": "application/json"})
            return
        found = self.assets.answer(path, headers.get("accept-encoding", ""), headers.get("if-none-match", ""))
        if found is None:
            await _send(send, 404, _error(f"no UI asset at {path}", "not_found_error"), {})
            return
        await _send(send, *found)


def _error(message: str, kind: str = "invalid_request_error") -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()


async def _send(send, status: int, body: bytes, headers: dict[str, str]) -> None:
    headers = {"content-type": "application/json", **headers, "content-length": str(len(body))}
    await send({"type": "http.response.start", "status": status,
                "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})
    await send({"type": "http.response.body", "body": body})
