"""One log format for every tokenforge process (the API process, the engine core, `generate`).

    12:04:31.207 INFO  [api] tokenforge.server.app: serving SmolLM2-135M-Instruct on http://...
    12:04:30.911 INFO  [engine-core] tokenforge.executor.executor: KV cache: 1456 blocks ...

Each process calls configure_logging once, with its tag. Imports nothing from tokenforge.
"""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)-5s [{tag}] %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever sys.stderr is when a record is written, not the stream it was
    made with: a caller that swaps stderr (pytest's capture, a notebook) and later closes the old
    one would otherwise get "I/O operation on closed file" for every record after."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_logging(level: int | str, tag: str) -> None:
    """Route every logger (uvicorn's too) through one handler on stderr in LOG_FORMAT."""
    if isinstance(level, str):
        level = level.upper()
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT.format(tag=tag), datefmt=DATE_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
