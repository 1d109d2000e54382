"""The W4 bench's streaming client: one raw HTTP/1.1 connection per request, SSE parsed once.

In: an Endpoint (the server's URL and API key) and a request (token ids, output length). Out: a
RequestResult with TTFT, the gaps between content chunks, e2e time and the usage chunk's token
count. The client must cost far less than the server it measures (see Endpoint).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import urllib.parse
from dataclasses import dataclass, field

DEFAULT_TIMEOUT_S = 3600.0


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)


class Endpoint:
    """Where the streamed completions go: one raw HTTP/1.1 connection per request (asyncio
    streams, TLS for https). The bench client must cost far less than the server it measures:
    httpx spent ~140 us of client CPU per streamed token (line iteration, h11, anyio), which at
    ~10k tokens/s is more than one core; this client parses each SSE event once (~25 us/token)."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"bench URL must be http(s)://host[:port], got {url!r}")
        self.host = parts.hostname
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.port = parts.port or (443 if self.ssl else 80)
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self.head = (f"POST {parts.path.rstrip('/')}/v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                     f"Content-Type: application/json\r\nAccept: text/event-stream\r\n{auth}"
                     "Connection: close\r\n").encode()


async def _one(ep: Endpoint, model: str, prompt: list[int], output_len: int,
               timeout: float = DEFAULT_TIMEOUT_S) -> RequestResult:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}).encode()
    result = RequestResult(start=time.perf_counter())
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(ep.host, ep.port, ssl=ep.ssl, limit=1 << 20)
            writer.write(ep.head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            status, chunked = _status(await reader.readuntil(b"\r\n\r\n"))
            if status != 200:
                payload = await reader.read(1 << 16)
                if chunked:
                    payload = bytes(_dechunk(bytearray(payload), bytearray())[0])
                result.error = f"HTTP {status}: {payload[:200]!r}"
                return result
            await _read_events(reader, chunked, result)
        if not result.error:
            result.e2e = time.perf_counter() - result.start
            result.ok = result.output_tokens > 0
            result.error = "" if result.ok else "no usage chunk"
    except (OSError, EOFError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as err:
        result.error = f"{type(err).__name__}: {err}"
    finally:
        if writer is not None:
            writer.close()
    return result


def _status(head: bytes) -> tuple[int, bool]:
    """(status code, chunked transfer encoding) of a response head."""
    lines = head.decode("latin-1").lower().split("\r\n")
    fields = lines[0].split(" ", 2)
    if len(fields) < 2 or not fields[1].isdigit():
        raise EOFError(f"not an HTTP response: {lines[0][:80]!r}")
    chunked = any(line.startswith("transfer-encoding:") and "chunked" in line for line in lines[1:])
    return int(fields[1]), chunked


def _dechunk(raw: bytearray, out: bytearray) -> tuple[bytearray, bool]:
    """Move the complete chunks of `raw` (chunked transfer encoding) into `out`, consuming them
    from `raw`; returns (out, whether the last chunk was seen)."""
    pos = 0
    while True:
        eol = raw.find(b"\r\n", pos)
        if eol < 0:
            break
        size = int(bytes(raw[pos:eol]).split(b";", 1)[0], 16)
        if size == 0:
            del raw[:]
            return out, True
        if len(raw) < eol + 2 + size + 2:
            break
        out += raw[eol + 2:eol + 2 + size]
        pos = eol + 2 + size + 2
    del raw[:pos]
    return out, False


async def _read_events(reader: asyncio.StreamReader, chunked: bool, result: RequestResult) -> None:
    """Read SSE events to [DONE] (or the end of the body), timing each content chunk."""
    raw, sse, last = bytearray(), bytearray(), None
    while True:
        data = await reader.read(1 << 16)
        now = time.perf_counter()
        ended = not data
        if chunked:
            raw += data
            sse, ended = _dechunk(raw, sse)
            ended = ended or not data
        else:
            sse += data
        *events, rest = sse.split(b"\n\n")
        sse = bytearray(rest)
        for event in events:
            for line in event.split(b"\n"):
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    return
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = (chunk["error"] or {}).get("message", "stream error")
                    return
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if last is None:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    last = now
        if ended:
            return
