"""Reasoning parsers (`--reasoning-parser`): the model's thinking as `reasoning_content`, apart
from the answer, as vLLM returns it. One parser is chosen at start-up and checked against the
model's tokenizer; see base.py for the interface."""

from __future__ import annotations

from tokenforge.server.reasoning.base import ParsedDelta, ReasoningParser, ReasoningStream
from tokenforge.server.reasoning.harmony import HarmonyReasoningParser
from tokenforge.server.reasoning.qwen3 import Qwen3ReasoningParser

__all__ = ["REASONING_PARSERS", "ParsedDelta", "ReasoningParser", "ReasoningStream", "check_parser_name",
           "get_reasoning_parser"]

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (HarmonyReasoningParser,
                                                                            Qwen3ReasoningParser)}


def check_parser_name(name: str) -> None:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}")


def get_reasoning_parser(name: str, tokenizer) -> ReasoningParser:
    """The parser `name`, checked against the model's tokenizer (ValueError: one line)."""
    check_parser_name(name)
    return REASONING_PARSERS[name](tokenizer)
