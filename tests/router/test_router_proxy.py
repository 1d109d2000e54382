"""The router's proxy against scripted upstreams (httpx MockTransport), in milliseconds: retries
before the first byte only, ejection on a connect error, chunk-by-chunk pass-through, auth."""

from __future__ import annotations

import asyncio
import json

import httpx

from tokenforge.router.metrics import RouterMetrics
from tokenforge.router.policy import Policy
from tokenforge.router.proxy import RouterApp
from tokenforge.router.replicas import Replica, ReplicaPool
from tokenforge.router.settings import RouterSettings

URLS = ["http://a-refused:1", "http://b-draining:1", "http://c-good:1"]      # round-robin order


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes], fail_after: int | None = None) -> None:
        self.chunks, self.fail_after = chunks, fail_after

    async def __aiter__(self):
        for i, chunk in enumerate(self.chunks):
            if i == self.fail_after:
                raise httpx.ReadError("replica died mid-stream")
            yield chunk


def _app(handler, **settings) -> tuple[RouterApp, list[str]]:
    calls: list[str] = []

    async def record(request: httpx.Request) -> httpx.Response:
        calls.append(f"{request.url.host}")
        return await handler(request)

    client = httpx.AsyncClient(transport=httpx.MockTransport(record))
    config = RouterSettings(replicas=tuple(URLS), policy="round-robin", **settings)
    metrics = RouterMetrics()
    pool = ReplicaPool(config, None, client, on_change=metrics.on_change)
    for url in URLS:
        pool.replicas[url] = Replica(url, state="admitted", healthy=True)
    return RouterApp(config, pool, Policy("round-robin", 16), None, client, metrics), calls


def _call(app: RouterApp, path: str = "/v1/completions", body: dict | None = None,
          headers: list | None = None) -> tuple[int, list[bytes], dict]:
    sent: list[dict] = []
    incoming = [{"type": "http.request", "body": json.dumps(body or {}).encode(), "more_body": False}]

    async def receive():
        if incoming:
            return incoming.pop(0)
        await asyncio.sleep(3600)          # the client stays connected

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "headers": headers or []}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body" and m.get("body")]
    return start["status"], bodies, dict(start["headers"])


def _draining() -> httpx.Response:
    return httpx.Response(503, stream=_Chunks([b'{"error": {"message": "draining"}}']))


async def _upstream(request: httpx.Request) -> httpx.Response:
    host = request.url.host
    if host == "a-refused":
        raise httpx.ConnectError("connection refused")
    if host == "b-draining":
        return _draining()
    return httpx.Response(200, stream=_Chunks([b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]))


def test_connect_errors_and_503_go_to_the_next_replica_and_chunks_pass_through():
    app, calls = _app(_upstream)
    status, chunks, headers = _call(app, body={"prompt": "hi"})
    assert calls == ["a-refused", "b-draining", "c-good"]
    assert status == 200 and chunks == [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]   # one event each
    assert headers[b"x-tokenforge-replica"] == b"http://c-good:1"
    assert app.pool.replicas["http://a-refused:1"].state == "ejected"          # at once, on a connect error
    assert app.pool.replicas["http://b-draining:1"].admitted                   # a 503 is not a failure
    assert all(r.in_flight == 0 for r in app.pool.replicas.values())
    metrics = app.metrics.render(app.pool).decode()
    assert 'tokenforge_router:retries_total{cause="ConnectError"} 1.0' in metrics
    assert 'tokenforge_router:retries_total{cause="503"} 1.0' in metrics


def test_nothing_is_retried_once_streaming_has_started():
    async def breaks(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=_Chunks([b"data: 1\n\n", b"data: 2\n\n"], fail_after=1))

    app, calls = _app(breaks)
    status, chunks, _ = _call(app, body={"prompt": "hi"})
    assert status == 200 and chunks == [b"data: 1\n\n"] and len(calls) == 1
    assert 'failed_requests_total{kind="mid_stream"} 1.0' in app.metrics.render(app.pool).decode()


def test_the_last_replica_answer_is_passed_on_when_every_one_is_draining():
    async def draining(request: httpx.Request) -> httpx.Response:
        return _draining()

    app, calls = _app(draining)
    status, chunks, _ = _call(app, body={"prompt": "hi"})
    assert status == 503 and len(calls) == 3 and b"draining" in b"".join(chunks)


def test_the_router_checks_its_own_keys_and_health_needs_none():
    app, calls = _app(_upstream, api_keys=("sk-router",))
    assert _call(app, body={"prompt": "hi"})[0] == 401 and calls == []
    assert _call(app, body={"prompt": "hi"}, headers=[(b"authorization", b"Bearer sk-wrong")])[0] == 401
    assert _call(app, body={"prompt": "hi"}, headers=[(b"authorization", b"Bearer sk-router")])[0] == 200
    assert _call(app, path="/health")[0] == 200
