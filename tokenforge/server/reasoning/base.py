"""The reasoning-parser interface: model text in, reasoning / content / tool calls out, incrementally.

A `ReasoningParser` is chosen once at start-up (`--reasoning-parser`) and checked against the
model's tokenizer then. Each choice of each chat request gets its own `ReasoningStream`, primed
with the rendered prompt (a template may open the thinking block there). The stream is fed the
detokenized text deltas as they arrive and returns what each delta resolves to; `finish()` flushes
what was held back. The non-streaming path feeds the same deltas, so both paths agree: feeding a
text whole or split anywhere gives the same concatenated result (tests/server/test_reasoning_parsers.py).

`MarkerSplitter` is the shared piece: it cuts text at a set of marker strings and holds back a
tail that could still grow into one, so a marker split across deltas is still seen whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tokenforge.server.tool_parsers import ToolCall


@dataclass(slots=True)
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __add__(self, other: ParsedDelta) -> ParsedDelta:
        return ParsedDelta(self.reasoning + other.reasoning, self.content + other.content,
                           [*self.tool_calls, *other.tool_calls])


class ReasoningStream:
    """One choice's parser state."""

    def feed(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        """The output ended: release what was held back (idempotent)."""
        raise NotImplementedError


class ReasoningParser:
    name = ""
    keeps_special_tokens = False    # the format's markers are special tokens: decode with them kept
    emits_tool_calls = False        # tool calls come out of the format itself, not the content text
    markers: tuple[str, ...] = ()   # each must be one token of the model's vocabulary
    format = ""                     # what the format is, for the start-up error

    def __init__(self, tokenizer) -> None:
        missing = [m for m in self.markers if not is_single_token(tokenizer, m)]
        if missing:
            raise ValueError(f"--reasoning-parser {self.name}: the model's tokenizer has no {' / '.join(missing)} "
                             f"token{'s' if len(missing) > 1 else ''}, so this model does not speak {self.format}; "
                             "leave --reasoning-parser out, or pick the parser of the model's own format")

    def stream(self, prompt: str) -> ReasoningStream:
        raise NotImplementedError

    def answer_marker(self, prompt: str) -> list[int] | None:
        """The token ids after which the output is the answer, for a grammar that must constrain
        only the answer; None when the prompt already ended the thinking (constrain from the start)."""
        raise NotImplementedError

    def parse(self, prompt: str, text: str) -> ParsedDelta:
        """A whole output at once (the same stream, fed once)."""
        stream = self.stream(prompt)
        return stream.feed(text) + stream.finish()


def is_single_token(tokenizer, text: str) -> bool:
    """Whether `text` is one token of the vocabulary that decodes back to itself."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=False) == text
    except (TypeError, ValueError):
        return False


class MarkerSplitter:
    """Text -> a list of ("text", s) and ("marker", m) segments, across calls: a tail that is a
    proper prefix of a marker waits for the next call (or `flush`)."""

    def __init__(self, markers: tuple[str, ...]) -> None:
        self._pattern = re.compile("|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)))
        self._prefixes = {m[:k] for m in markers for k in range(1, len(m))}
        self._longest = max(len(m) for m in markers)
        self._tail = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        buf, out, pos = self._tail + text, [], 0
        for match in self._pattern.finditer(buf):
            if match.start() > pos:
                out.append(("text", buf[pos:match.start()]))
            out.append(("marker", match.group()))
            pos = match.end()
        keep = next((k for k in range(min(self._longest - 1, len(buf) - pos), 0, -1)
                     if buf[len(buf) - k:] in self._prefixes), 0)
        if len(buf) - keep > pos:
            out.append(("text", buf[pos:len(buf) - keep]))
        self._tail = buf[len(buf) - keep:]
        return out

    def flush(self) -> list[tuple[str, str]]:
        tail, self._tail = self._tail, ""
        return [("text", tail)] if tail else []
