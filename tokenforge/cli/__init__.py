"""The `tokenforge` command line (torch-free to build): see main.py.

    from tokenforge.cli import main, build_parser, engine_kwargs
"""

from tokenforge.cli.engine_args import add_engine_args, engine_kwargs
from tokenforge.cli.main import build_parser, console_main, main

__all__ = ["add_engine_args", "build_parser", "console_main", "engine_kwargs", "main"]
