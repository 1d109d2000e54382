"""Pure-ASGI gates in front of every route: service state (draining, dead engine) and body size.

The access log (--enable-access-log) writes one line per request when its response is done:
method, path, status, prompt and completion tokens, time to first token and total time.

The state gate answers 503 for everything but /health (which reports the state itself) once
the server is draining after SIGTERM or the engine core has died. The body gate refuses a body
over the limit with 413 before any of it is parsed, whether or not it declared Content-Length.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tokenforge.server.errors import body_too_large, unavailable
from tokenforge.server.metrics import CURRENT_ACCESS, AccessRecord

access_logger = logging.getLogger("tokenforge.access")


class ServiceStateMiddleware:
    def __init__(self, app, unavailable_reason: Callable[[], str | None]) -> None:
        self.app = app
        self.unavailable_reason = unavailable_reason

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            reason = self.unavailable_reason()
            if reason is not None:
                await unavailable(reason).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await body_too_large(self.max_bytes).response()(scope, receive, send)
            return
        try:
            body, disconnected = await self._read(receive)
        except _BodyTooLarge:
            await body_too_large(self.max_bytes).response()(scope, receive, send)
            return
        await self.app(scope, _replay(body, disconnected, receive), send)

    async def _read(self, receive) -> tuple[bytes, bool]:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"".join(chunks), True
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, disconnected: bool, receive):
    """A receive() that hands the buffered body over once, then passes through (for disconnects)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            if disconnected:
                return {"type": "http.disconnect"}
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class AccessLogMiddleware:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = AccessRecord()
        token = CURRENT_ACCESS.set(record)
        status = 500

        async def send_and_watch(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            CURRENT_ACCESS.reset(token)
            ttft = "-" if record.ttft is None else f"{record.ttft * 1000:.1f}ms"
            access_logger.info("%s %s %d tokens_in=%d tokens_out=%d ttft=%s total=%.1fms", scope["method"],
                               scope["path"], status, record.prompt_tokens, record.completion_tokens, ttft,
                               (time.time() - record.start) * 1000)
