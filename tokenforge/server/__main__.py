"""`python -m tokenforge.server [flags]`: the server without the full CLI (tests use it)."""

from __future__ import annotations

import argparse
import sys

from tokenforge.server.cli_args import add_engine_args, add_server_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenforge.server",
                                     description="OpenAI-compatible tokenforge server")
    add_server_args(add_engine_args(parser))
    args = parser.parse_args(argv)
    from tokenforge.server.app import run_server  # noqa: PLC0415 - keep --help fast

    return run_server(args)


if __name__ == "__main__":
    sys.exit(main())
