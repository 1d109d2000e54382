"""Qwen3's thinking: `<think> ... </think>` before the answer (also QwQ and DeepSeek-R1 style).

- The model opens the block itself (Qwen3's template), or the template pre-fills `<think>` at the
  end of the prompt (QwQ, Qwen3-*-Thinking-2507): then the output starts inside the block and only
  `</think>` appears in it. A prompt that ends in `<think>` (after trailing whitespace) says so.
- `enable_thinking=False` (in chat_template_kwargs): Qwen3's template closes an empty block in the
  prompt, so the whole output is content.
- Whitespace at the edges of the thinking, and between `</think>` and the answer, is dropped
  (the template writes newlines there); the answer's own text is kept as is. An output cut off
  inside the block is all reasoning. Tool calls (`<tool_call>`) in the answer are left to the
  tool-call parser, which reads the content.
"""

from __future__ import annotations

from tokenforge.server.reasoning.base import MarkerSplitter, ParsedDelta, ReasoningParser, ReasoningStream

THINK, END_THINK = "<think>", "</think>"


class Qwen3Stream(ReasoningStream):
    def __init__(self, thinking: bool) -> None:
        self._splitter = MarkerSplitter((THINK, END_THINK))
        self._thinking = thinking
        self._segment_open = False      # the current reasoning / post-think content has non-blank text
        self._after_think = False       # content right after a `</think>`: its leading blank is dropped
        self._blank = ""                # reasoning's trailing whitespace, out only if more text follows
        self._finished = False

    def feed(self, text: str) -> ParsedDelta:
        return self._apply(self._splitter.feed(text))

    def finish(self) -> ParsedDelta:
        if self._finished:
            return ParsedDelta()
        self._finished = True
        out = self._apply(self._splitter.flush())
        self._blank = ""                # a thought cut off ends without its trailing whitespace
        return out

    def _apply(self, segments: list[tuple[str, str]]) -> ParsedDelta:
        out = ParsedDelta()
        for kind, text in segments:
            if kind == "marker" and text == THINK and not self._thinking:
                self._thinking, self._segment_open = True, False
            elif kind == "marker" and text == END_THINK and self._thinking:
                self._thinking, self._segment_open, self._after_think, self._blank = False, False, True, ""
            elif self._thinking:
                out.reasoning += self._reasoning_text(text)
            else:
                out.content += self._content_text(text)
        return out

    def _reasoning_text(self, text: str) -> str:
        if not self._segment_open:
            text = text.lstrip()
            if not text:
                return ""
            self._segment_open = True
        text = self._blank + text
        body = text.rstrip()
        self._blank = text[len(body):]
        return body

    def _content_text(self, text: str) -> str:
        if self._after_think and not self._segment_open:
            text = text.lstrip()
            if not text:
                return ""
            self._segment_open = True
        return text


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    markers = (THINK, END_THINK)
    format = "Qwen3's <think> ... </think> reasoning"

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self._end_ids = tokenizer.encode(END_THINK, add_special_tokens=False)

    def stream(self, prompt: str) -> Qwen3Stream:
        return Qwen3Stream(thinking=prompt.rstrip().endswith(THINK))

    def answer_marker(self, prompt: str) -> list[int] | None:
        """`</think>`, unless the prompt closed the block (enable_thinking=False)."""
        return None if prompt.rstrip().endswith(END_THINK) else list(self._end_ids)
