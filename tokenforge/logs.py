"""One log format for every tokenforge process (the API process, the engine core, `generate`).

    12:04:31.207 INFO  [api] tokenforge.server.app: serving SmolLM2-135M-Instruct on http://...
    12:04:30.911 INFO  [engine-core] tokenforge.executor.executor: KV cache: 1456 blocks ...

Each process calls configure_logging once, with its tag. Imports nothing from tokenforge.
"""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)-5s [{tag}] %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"


def configure_logging(level: int | str, tag: str) -> None:
    """Route every logger (uvicorn's too) through one handler on stderr in LOG_FORMAT."""
    if isinstance(level, str):
        level = level.upper()
    logging.basicConfig(level=level, format=LOG_FORMAT.format(tag=tag), datefmt=DATE_FORMAT, force=True)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
