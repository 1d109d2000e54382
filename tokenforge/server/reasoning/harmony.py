"""gpt-oss's harmony format, parsed from the decoded text with its special tokens kept.

    <|start|>assistant<|channel|>analysis<|message|>...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>...<|return|>

A message is a header (role, `<|channel|>NAME`, an optional recipient `to=...` before or after
the channel, an optional `<|constrain|>` content type) and a body after `<|message|>`, ended by
`<|end|>`, `<|call|>` or `<|return|>` (the last two are end-of-sequence tokens, so the output
usually just stops there). The generation prompt ends inside the first header
(`<|start|>assistant`), so the stream is primed with the prompt's last message.

Bodies map to the API as: `analysis` -> reasoning_content; `final` and `commentary` without a
recipient (a preamble) -> content; a recipient `functions.NAME` -> a tool call NAME with the body
as its JSON arguments; another recipient (a built-in tool the server does not run) -> reasoning.
A call whose body is not JSON (cut off by max_tokens) stays text, in the content. Text outside any
message is content: so is an output with no header at all (a response constrained by a grammar from
its first token).

openai-harmony is not used: its encoding downloads the o200k vocabulary at run time, and the
tiny test checkpoints have their own tokenizers; only the format's text is needed here.
"""

from __future__ import annotations

import json
import re

from tokenforge.server.reasoning.base import MarkerSplitter, ParsedDelta, ReasoningParser, ReasoningStream
from tokenforge.server.tool_parsers import ToolCall

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
FINAL_HEADER = CHANNEL + "final" + MESSAGE      # the answer's message starts after it
_HEADER_MARKERS = (CHANNEL, CONSTRAIN)
_BODY_ENDS = (END, CALL, RETURN)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT_START = re.compile(r"\s*(t(o(=.*)?)?)?", re.DOTALL)   # what may follow the role in a header
_OUTSIDE, _HEADER, _BODY = "outside", "header", "body"


class HarmonyStream(ReasoningStream):
    def __init__(self, prompt_tail: str | None, ignored: tuple[str, ...] = ()) -> None:
        self._ignored = ignored         # other end-of-sequence tokens' text: dropped wherever it appears
        self._splitter = MarkerSplitter(MARKERS + ignored)
        self._mode, self._header, self._body, self._kind, self._name = _OUTSIDE, "", "", "content", ""
        self._fresh = False             # in the prompt's header, before the output's first marker
        self._header_output = ""        # the output's text while fresh
        self._finished = False
        if prompt_tail is not None:     # the output continues the prompt's last message
            primer = MarkerSplitter(MARKERS)
            self._apply([*primer.feed(START + prompt_tail), *primer.flush()], ParsedDelta())
            self._fresh = self._mode == _HEADER

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._apply(self._splitter.feed(text), out)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._finished:
            return out
        self._finished = True
        self._apply(self._splitter.flush(), out)
        if self._mode == _HEADER and self._fresh:
            out.content += self._header_output      # a header that never became one: plain text
        elif self._mode == _BODY:
            self._end_body(out)
        return out

    # ---- the state machine ------------------------------------------------------------------

    def _apply(self, segments: list[tuple[str, str]], out: ParsedDelta) -> None:
        for kind, text in segments:
            if kind == "marker" and text in self._ignored:
                continue
            if self._mode == _HEADER:
                self._in_header(kind, text, out)
            elif self._mode == _BODY:
                if kind == "marker" and text in _BODY_ENDS:
                    self._end_body(out)
                    self._mode = _OUTSIDE
                elif kind == "marker" and text == START:     # a body cut short by a new message
                    self._end_body(out)
                    self._open_header()
                else:
                    self._in_body(text, out)
            elif kind == "marker" and text in (START, CHANNEL):
                self._open_header(CHANNEL if text == CHANNEL else "")
            elif kind == "text":
                out.content += text
            # other markers between messages carry nothing

    def _open_header(self, text: str = "") -> None:
        self._mode, self._header, self._header_output, self._fresh = _HEADER, text, "", False

    def _in_header(self, kind: str, text: str, out: ParsedDelta) -> None:
        if self._fresh and kind == "text":
            self._header_output += text
            if _RECIPIENT_START.fullmatch(self._header_output) is None:     # not a header after all
                self._mode, self._fresh = _OUTSIDE, False
                out.content += self._header_output
            return
        if self._fresh:         # the output's first marker: what it wrote before is part of the header
            self._header, self._fresh = self._header + self._header_output, False
        if kind == "text" or text in _HEADER_MARKERS:
            self._header += text
        elif text == MESSAGE:
            self._begin_body()
        elif text == START:
            self._open_header()
        else:                   # a message ended before its body began: nothing to say
            self._mode = _OUTSIDE

    def _begin_body(self) -> None:
        recipient = _RECIPIENT.search(self._header)
        channel = _CHANNEL.search(self._header)
        channel = channel.group(1) if channel else ""
        self._mode, self._body, self._name = _BODY, "", ""
        if recipient and recipient.group(1).startswith("functions."):
            self._kind, self._name = "call", recipient.group(1).removeprefix("functions.")
        elif recipient or channel == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "content"

    def _in_body(self, text: str, out: ParsedDelta) -> None:
        if self._kind == "call":
            self._body += text
        elif self._kind == "reasoning":
            out.reasoning += text
        else:
            out.content += text

    def _end_body(self, out: ParsedDelta) -> None:
        if self._kind == "call":
            args = self._body.strip()
            try:
                json.loads(args)
                out.tool_calls.append(ToolCall(self._name, args))
            except json.JSONDecodeError:
                out.content += self._body
        self._kind, self._body = "content", ""


class HarmonyReasoningParser(ReasoningParser):
    name = "gpt_oss"
    keeps_special_tokens = True
    emits_tool_calls = True
    markers = (START, CHANNEL, MESSAGE, END)
    format = "OpenAI's harmony format (gpt-oss)"

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        texts = (tokenizer.decode([i], skip_special_tokens=False) for i in getattr(tokenizer, "eos_token_ids", ()))
        self.ignored = tuple(t for t in dict.fromkeys(texts) if t.strip() and t not in MARKERS)
        self._final_ids = tokenizer.encode(FINAL_HEADER, add_special_tokens=False)

    def stream(self, prompt: str) -> HarmonyStream:
        at = prompt.rfind(START)
        tail = prompt[at + len(START):] if at >= 0 else None
        if tail is not None and any(end in tail for end in _BODY_ENDS):
            tail = None         # the prompt's last message is closed: the output starts between messages
        return HarmonyStream(tail, self.ignored)

    def answer_marker(self, prompt: str) -> list[int] | None:
        """The final channel's header, unless the prompt already opened the final message."""
        return None if prompt.rstrip().endswith(FINAL_HEADER) else list(self._final_ids)
