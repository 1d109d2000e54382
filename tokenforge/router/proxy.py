"""The router's HTTP face: the OpenAI API passed through to a chosen replica, plus its own
/health, /metrics and /router/replicas.

A pure ASGI app (no framework between the sockets), so streams pass through unbuffered: every
chunk the replica sends is written to the client as it arrives. The body of a request is read
once; /v1/completions and /v1/chat/completions are placed by their prefix key, everything else
by load. Until the replica's response headers arrive, a connect error, a broken connection or a
503 sends the request to the next replica in the policy's order (at most `retries` more); once a
byte went to the client nothing is retried. A client that goes away closes the upstream
connection, which the replica sees as a disconnect and aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging

import httpx

from tokenforge.router.metrics import RouterMetrics
from tokenforge.router.policy import Policy
from tokenforge.router.replicas import Replica, ReplicaPool
from tokenforge.router.settings import RouterSettings
from tokenforge.router.ui import RouterUI

logger = logging.getLogger(__name__)

PLACED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
                         b"proxy-authorization", b"proxy-authenticate", b"host", b"content-length"})
_MAX_BODY = 64 << 20


def _json(status: int, body: dict) -> tuple[int, bytes]:
    return status, json.dumps(body).encode()


def _error(status: int, message: str, kind: str) -> tuple[int, bytes]:
    return _json(status, {"error": {"message": message, "type": kind, "param": None, "code": None}})


class RouterApp:
    def __init__(self, settings: RouterSettings, pool: ReplicaPool, policy: Policy, hasher,
                 client: httpx.AsyncClient, metrics: RouterMetrics) -> None:
        self.settings = settings
        self.pool = pool
        self.policy = policy
        self.hasher = hasher                 # PromptPrefixHasher, or None for load-only policies
        self.client = client
        self.metrics = metrics
        self.keys = [k.encode() for k in settings.api_keys]
        self.ui = RouterUI(settings, pool, metrics) if settings.ui else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/health":
            admitted = len(self.pool.admitted())
            status = 200 if admitted else 503
            await _respond(send, *_json(status, {"status": "ok" if admitted else "no replica admitted",
                                                 "replicas_admitted": admitted}))
            return
        if self.keys and not self._authorized(scope):
            await _respond(send, *_error(401, "Missing or invalid API key.", "authentication_error"))
            return
        if path == "/metrics":
            await _respond(send, 200, self.metrics.render(self.pool), self.metrics.content_type)
        elif path == "/ui" or path.startswith("/ui/"):       # the router's own pages, never a replica's
            if self.ui is None:
                await _respond(send, *_error(404, "The web UI is off (--no-ui).", "not_found_error"))
            else:
                await self.ui(scope, receive, send)
        elif path == "/router/replicas":
            await _respond(send, *_json(200, {"replicas": [_describe(r) for r in self.pool.replicas.values()]}))
        else:
            await self._proxy(scope, receive, send)

    def _authorized(self, scope) -> bool:
        token = _bearer(scope)
        ok = False
        for key in self.keys:                # every key compared: the timing reveals nothing
            ok |= token is not None and hmac.compare_digest(token, key)
        return ok

    async def _proxy(self, scope, receive, send) -> None:
        body, disconnected = await _read_body(receive)
        if disconnected:
            return
        if body is None:
            await _respond(send, *_error(413, f"The request body exceeds {_MAX_BODY} bytes.", "invalid_request_error"))
            return
        key, model = self._placement(scope, body)
        order, reason = self.policy.order(self.pool.admitted(), key, model)
        if not order:
            self.metrics.failed.labels("no_replica").inc()
            await _respond(send, *_error(503, "No replica is available.", "service_unavailable"))
            return
        for attempt, replica in enumerate(order[: 1 + self.settings.retries]):
            last = attempt == min(len(order), 1 + self.settings.retries) - 1
            response = await self._send_upstream(scope, body, replica, retryable=not last)
            if response is None:
                continue
            self.metrics.requests.labels(replica.url, reason if attempt == 0 else "retry").inc()
            await self._relay(response, replica, receive, send)
            return
        self.metrics.failed.labels("all_attempts_failed").inc()
        await _respond(send, *_error(503, "No replica could take the request (all attempts failed).",
                                     "service_unavailable"))

    def _placement(self, scope, body: bytes) -> tuple[bytes | None, str | None]:
        """(the prompt's prefix key, the `model` it names) of a placed request's body."""
        if scope["path"] not in PLACED_PATHS:
            return None, None
        try:
            parsed = json.loads(body)
            if not isinstance(parsed, dict):
                return None, None
            model = parsed.get("model") if isinstance(parsed.get("model"), str) else None
            return (self.hasher.prefix_key(parsed) if self.hasher is not None else None), model
        except (ValueError, TypeError):
            return None, None    # the replica answers the malformed body with its own 400

    async def _send_upstream(self, scope, body: bytes, replica: Replica, retryable: bool) -> httpx.Response | None:
        """The replica's response with its headers read; None when the next replica should try."""
        query = scope.get("query_string", b"").decode()
        url = replica.url + scope["path"] + (f"?{query}" if query else "")
        request = self.client.build_request(scope["method"], url, headers=self._upstream_headers(scope), content=body)
        replica.in_flight += 1
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TransportError as err:
            replica.in_flight -= 1
            self.pool.fail(replica, f"{type(err).__name__}: {err}".rstrip(": "), at_once=isinstance(err, httpx.ConnectError))
            self.metrics.retries.labels(type(err).__name__).inc()
            logger.warning("replica %s: %s before the response; %s", replica.url, type(err).__name__,
                           "trying another" if retryable else "no replica left")
            return None
        if response.status_code == 503 and retryable:
            replica.in_flight -= 1
            await response.aclose()
            self.metrics.retries.labels("503").inc()
            return None
        return response

    def _upstream_headers(self, scope) -> list[tuple[bytes, bytes]]:
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP_BY_HOP]
        if self.settings.replica_api_key:
            headers = [(k, v) for k, v in headers if k.lower() != b"authorization"]
            headers.append((b"authorization", f"Bearer {self.settings.replica_api_key}".encode()))
        return headers

    async def _relay(self, response: httpx.Response, replica: Replica, receive, send) -> None:
        """Pass the response through chunk by chunk until it ends or the client goes away."""
        headers = [(k, v) for k, v in response.headers.raw if k.lower() not in _HOP_BY_HOP]
        headers.append((b"x-tokenforge-replica", replica.url.encode()))
        pump = asyncio.ensure_future(_pump(response, send, headers))
        watcher = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if pump.done() and pump.exception() is not None:
                self.metrics.failed.labels("mid_stream").inc()
                logger.warning("replica %s broke off a response mid-stream: %r", replica.url, pump.exception())
        finally:
            for task in (pump, watcher):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pump
            await response.aclose()          # closes the connection if unfinished: the replica aborts
            replica.in_flight -= 1


async def _pump(response: httpx.Response, send, headers) -> None:
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    try:
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    finally:
        with contextlib.suppress(Exception):     # end the body even when the replica broke off
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _read_body(receive) -> tuple[bytes | None, bool]:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None, True
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > _MAX_BODY:
            return None, False
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), False


async def _respond(send, status: int, body: bytes, content_type: str = "application/json") -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _bearer(scope) -> bytes | None:
    for name, value in scope.get("headers", []):
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


def _describe(r: Replica) -> dict:
    return {"url": r.url, "state": r.state, "reason": r.reason, "healthy": r.healthy, "waiting": r.waiting,
            "running": r.running, "kv_usage": r.kv_usage, "in_flight": r.in_flight, "model": r.model_name,
            "version": r.version, "checksum": r.checksum, "adapters": sorted(r.adapters)}
