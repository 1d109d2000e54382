"""The W4 bench's raw HTTP/1.1 streaming client against scripted servers: chunked bodies split at
awkward places, plain bodies, HTTP errors, errors inside the stream, refused connections."""

import asyncio
import json
import socket

import pytest

from tokenforge.bench.serving import serve


def _events(texts: list[str], tokens: int) -> bytes:
    out = b""
    for text in texts:
        out += b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"
    out += b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": tokens}}).encode() + b"\n\n"
    return out + b"data: [DONE]\n\n"


def _chunked(payload: bytes, sizes: list[int]) -> bytes:
    out, pos, i = b"", 0, 0
    while pos < len(payload):
        size = sizes[i % len(sizes)]
        out += b"%x\r\n" % len(payload[pos:pos + size]) + payload[pos:pos + size] + b"\r\n"
        pos, i = pos + size, i + 1
    return out + b"0\r\n\r\n"


def _run(script: list[bytes], pause: float = 0.002) -> tuple[serve.RequestResult, bytes]:
    """One request against a server that reads the request, then writes `script` piece by piece."""
    seen = {}

    async def main():
        async def handle(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            seen["request"] = head + await reader.readexactly(length)
            for piece in script:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(pause)
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            ep = serve.Endpoint(f"http://127.0.0.1:{port}", api_key="sk-test")
            return await serve._one(ep, "m", [1, 2, 3], 3, timeout=10)

    return asyncio.run(main()), seen.get("request", b"")


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


OK_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def test_chunked_stream_split_anywhere_counts_every_content_chunk():
    body = _chunked(_events(["", "a", "b", "c"], 3), sizes=[7, 50, 3])   # HTTP chunks cut through events
    for cuts in ([], [1, 2, 3], list(range(5, len(body), 11))):         # and reads cut through chunk headers
        result, request = _run([OK_HEAD, *_split(body, cuts)])
        assert result.ok and result.error == "" and result.output_tokens == 3
        assert len(result.itl) == 2 and result.ttft > 0 and result.e2e >= result.ttft
    assert request.startswith(b"POST /v1/completions HTTP/1.1\r\n") and b"Authorization: Bearer sk-test\r\n" in request
    body = json.loads(request.split(b"\r\n\r\n", 1)[1])
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 3 and body["stream"] is True


def test_plain_body_without_chunking():
    payload = _events(["x", "y"], 2)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % len(payload)
    result, _ = _run([head, payload[:10], payload[10:]])
    assert result.ok and result.output_tokens == 2 and len(result.itl) == 1


def test_http_error_status_and_body():
    body = b'{"error":{"message":"bad key","type":"invalid_request_error"}}'
    result, _ = _run([b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                      % len(body) + body])
    assert not result.ok and result.error == f"HTTP 401: {body!r}"
    result, _ = _run([b"HTTP/1.1 503 Service Unavailable\r\ntransfer-encoding: chunked\r\n\r\n" + _chunked(body, [9])])
    assert not result.ok and result.error == f"HTTP 503: {body!r}"


def test_error_event_inside_the_stream():
    payload = b'data: {"choices":[{"text":"a"}]}\n\ndata: {"error":{"message":"engine died"}}\n\n'
    result, _ = _run([OK_HEAD, _chunked(payload, [20])])
    assert not result.ok and result.error == "engine died"


def test_stream_cut_before_usage_is_a_failure():
    result, _ = _run([OK_HEAD, b"1c\r\ndata: {\"choices\":[{\"text\":\"a\"}]}\n\n"[:20]])
    assert not result.ok and result.error == "no usage chunk"


def test_refused_connection_is_reported_not_raised():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = asyncio.run(serve._one(serve.Endpoint(f"http://127.0.0.1:{port}"), "m", [1], 1, timeout=5))
    assert not result.ok and result.error.startswith("ConnectionRefusedError")


def test_endpoint_rejects_a_url_without_scheme():
    with pytest.raises(ValueError, match=r"http\(s\)://host"):
        serve.Endpoint("127.0.0.1:8000")
