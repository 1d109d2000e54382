"""The listening socket, bound before anything loads (a port in use is one line, like a bad flag).

Its own module, light to import: `serve` binds it before it imports the HTTP stack, so the engine
core gets its config as early as the flags allow.
"""

from __future__ import annotations

import socket


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening address first, so a port in use is an error before anything loads.

    The protocol is IPPROTO_TCP, not 0: accepted sockets inherit it, and asyncio turns Nagle off
    (TCP_NODELAY) only on sockets whose proto says TCP. With proto 0 every response after the
    first on a kept-alive connection sent its body ~40 ms late (Nagle waiting for the client's
    delayed ACK of the headers), and SSE chunks queued the same way."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"cannot listen on {host}:{port}: {err.strerror}") from None
    return sock
