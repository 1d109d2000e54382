"""Server-sent events, as OpenAI sends them: `data: {json}` frames, then `data: [DONE]`.

EngineEventStream is a StreamingResponse that always runs its cleanup (aborting unfinished
engine requests), even when the client disconnects before the first byte and the body
iterator never starts: a started-then-cancelled generator cleans up through its own `finally`,
but an unstarted one would not, and its request would run to max_tokens for nobody.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import msgspec
from fastapi.responses import StreamingResponse

from tokenforge.server.errors import APIError

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


# One encoder for every chunk: compact JSON, non-ASCII text as UTF-8 (as json.dumps with
# ensure_ascii=False and tight separators writes it), ~10x cheaper than json.dumps per chunk.
_ENCODER = msgspec.json.Encoder()


def sse(payload: dict) -> bytes:
    """One `data: {json}` event, as the bytes that go on the socket."""
    return b"data: " + _ENCODER.encode(payload) + b"\n\n"


class EngineEventStream(StreamingResponse):
    def __init__(self, events: AsyncIterator[str], cleanup: Callable[[], None]) -> None:
        super().__init__(_guard(events), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


async def _guard(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Turn a failure after the headers went out into an OpenAI error event, then [DONE]."""
    try:
        async for event in events:
            yield event
    except APIError as err:
        yield err.sse()
    except Exception:   # noqa: BLE001 - a bug must still end the stream with a well-formed error
        logger.exception("stream failed")
        yield APIError("Internal server error while streaming.", status=500).sse()
    yield DONE
