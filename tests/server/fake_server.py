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

from tokenforge.server.app import serve  # noqa: E402
from tokenforge.server.cli_args import add_engine_args, add_server_args, engine_config_from_args  # noqa: E402
from tokenforge.server.settings import ServerSettings  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    args = add_server_args(add_engine_args(parser)).parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    core_path = f"{FakeEngineCore.__module__}:FakeEngineCore"
    return asyncio.run(serve(engine_config_from_args(args), ServerSettings.from_args(args),
                             core_path=core_path, tokenizer=FakeTokenizer()))


if __name__ == "__main__":
    sys.exit(main())
