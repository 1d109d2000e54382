"""The `tokenforge` command line (torch-free to build): see main.py.

    from tokenforge.cli import main, build_parser, engine_kwargs

When this package is imported by the command itself (the `tokenforge` script, `python -m
tokenforge`, `python -m tokenforge.cli`) to run `serve`, its first statement starts the engine core
(engine/core_boot.py), before the CLI's own imports and argument parsing: the core's imports
(torch, the model code) are the longest serial step to /health, and they run while this process
imports the CLI and the server, checks the flags and loads the tokenizer. Imported by anything
else (a test, a script, the bench) it starts nothing.
"""

from tokenforge.engine.core_boot import launch_for_entry

launch_for_entry()

from tokenforge.cli.engine_args import add_engine_args, engine_kwargs  # noqa: E402
from tokenforge.cli.main import build_parser, console_main, main  # noqa: E402

__all__ = ["add_engine_args", "build_parser", "console_main", "engine_kwargs", "main"]
