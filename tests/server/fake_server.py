"""Launch the real server around the fake core and tokenizer (fakes.py): `python fake_server.py [flags]`.

Everything but the model is real: the engine-core process and its ZMQ transport, AsyncEngine,
the HTTP app, uvicorn, signals and exit codes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(os.path.dirname(_HERE))]   # fakes, and the repo root

from fakes import FakeEngineCore, FakeTokenizer  # noqa: E402

from tokenforge.cli import add_engine_args, engine_kwargs  # noqa: E402
from tokenforge.config import EngineConfig  # noqa: E402
from tokenforge.logs import configure_logging  # noqa: E402
from tokenforge.server.app import serve  # noqa: E402
from tokenforge.cli.serve import add_server_args  # noqa: E402
from tokenforge.server.settings import ServerSettings  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, serve=True)   # as `tokenforge serve` builds them: --model-checksum, --model-version too
    args = add_server_args(parser).parse_args()
    configure_logging(logging.INFO, "api")
    core_path = f"{FakeEngineCore.__module__}:FakeEngineCore"
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    return asyncio.run(serve(config, ServerSettings.from_args(args),
                             core_path=core_path, tokenizer=FakeTokenizer()))


if __name__ == "__main__":
    sys.exit(main())
