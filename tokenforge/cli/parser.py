"""The argparse pieces behind `tokenforge`: one-line errors, help with defaults, planned flags.

In: the parsers cli/main.py builds. Out: parsers whose errors are one line plus a pointer to --help
(the usage dump is for --help only), whose help shows each flag's default, and which answer a
planned, not yet implemented flag (PLANNED below) with one line saying so.

Nothing here imports torch: `tokenforge --help` must stay fast.
"""

from __future__ import annotations

import argparse

# Planned, not implemented yet: one row per flag, flag value or subcommand. Delete a row when
# its feature lands (a row whose flag or value already exists is ignored, so a late delete is
# harmless). The key is how a user spells it; the value says what it will do.
PLANNED: dict[str, str] = {
}


def planned_message(spelling: str) -> str:
    return f"{spelling} is not implemented yet (planned: {PLANNED[spelling]})"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and a hint, not the usage dump."""

    def error(self, message: str):   # noqa: D401 - argparse's signature
        self.exit(2, f"{self.prog}: error: {message}\n(run '{self.prog} --help' for the flags)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Raw descriptions and epilogs, and '(default: X)' after every flag that has a real default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or not _shows_default(action):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class _Planned(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="?", default=argparse.SUPPRESS,
                         metavar="VALUE", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(planned_message(self.option_strings[0]))


def add_planned_flags(parser: argparse.ArgumentParser) -> None:
    """Give `parser` every planned flag it lacks (one line: not implemented yet), and let the
    planned values of its existing flags through to check_planned_values."""
    group = None
    for spelling, what in PLANNED.items():
        if not spelling.startswith("--"):
            continue
        flag, _, value = spelling.partition(" ")
        action = parser._option_string_actions.get(flag)
        if value:
            if action is not None:
                _admit_value(action, value)
            continue
        if action is None:
            if group is None:
                group = parser.add_argument_group("planned, not implemented yet")
            group.add_argument(flag, action=_Planned, help=what)


def _admit_value(action: argparse.Action, value: str) -> None:
    """Let a planned value past the flag's type and choices; check_planned_values refuses it."""
    if action.choices is not None and value in action.choices:
        return   # the value exists: implemented
    original = action.type
    if original is not None and action.choices is None:
        try:
            original(value)
            return   # the type accepts it: implemented
        except (argparse.ArgumentTypeError, TypeError, ValueError):
            pass
    if action.choices is not None:
        action.choices = [*action.choices, value]
    if original is not None:
        action.type = lambda text, _orig=original, _value=value: text if text == _value else _orig(text)
    planned = getattr(action, "planned_values", set())
    planned.add(value)
    action.planned_values = planned


def check_planned_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, in one line, a planned value that add_planned_flags let through (in `parser` or
    the subcommand parsers that `args` chose)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None))
            if chosen is not None:
                check_planned_values(chosen, args)
        for value in getattr(action, "planned_values", ()):
            if getattr(args, action.dest, None) == value:
                parser.error(planned_message(f"{action.option_strings[0]} {value}"))


def add_planned_commands(subparsers) -> None:
    """Planned subcommands that do not exist yet: listed in --help (refuse_planned_command
    answers them, before parsing, whatever flags follow)."""
    for name, what in PLANNED.items():
        if not name.startswith("--") and name not in subparsers.choices:
            subparsers.add_parser(name, help=f"not implemented yet: {what}", add_help=False).set_defaults(
                planned_command=name)


def refuse_planned_command(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            command = next((a for a in argv if a in action.choices), None)
            if command is not None and action.choices[command].get_default("planned_command"):
                parser.error(planned_message(command).replace(command, f"'tokenforge {command}'", 1))


def fill_default_help(parser: argparse.ArgumentParser) -> None:
    """Flags without a help text still show their default (HelpFormatter adds it to the others)."""
    for action in parser._actions:
        if action.help is None and _shows_default(action):
            action.help = "(default: %(default)s)"


def _shows_default(action: argparse.Action) -> bool:
    """A flag that takes a value and has a real default (not None, not a switch's False)."""
    return (bool(action.option_strings) and action.nargs != 0 and action.default is not None
            and action.default is not argparse.SUPPRESS and not isinstance(action.default, bool))
