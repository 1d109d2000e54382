"""Model text -> OpenAI tool calls, for the formats the common chat templates teach their models.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5, Hermes;
  also the format tokenforge's own tool prompt asks for on templates without tool support).
- `llama3_json`: a JSON object `{"name": ..., "parameters": {...}}` as the whole answer, optionally
  after `<|python_tag|>`, several separated by `;` (Llama 3.1 / 3.2).
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` objects (or, in newer
  templates, `[TOOL_CALLS]name[ARGS]{...}`).

`parse(text)` returns the content outside the calls and the calls; text that does not parse as a
call stays content. `start_markers` tell the streaming path where to start holding text back.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str                  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        body = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return body if index is None else {"index": index, **body}


def call_from_json(obj) -> ToolCall | None:
    """{"name", "arguments" | "parameters"} -> a ToolCall (None if it is not one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class ToolParser:
    name = ""
    start_markers: tuple[str, ...] = ()

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    start_markers = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = [c for block in self._BLOCK.findall(text[start:]) if (c := call_from_json(_loads(block)))]
        if not calls:
            return text, []
        return text[:start].strip(), calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start_markers = ("<|python_tag|>", "{")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = call_from_json(obj)
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return "", calls


class MistralParser(ToolParser):
    name = "mistral"
    start_markers = ("[TOOL_CALLS]",)
    _NAMED = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_\-]+)\s*\[ARGS\]\s*", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return text, []
        rest = text[start:]
        calls: list[ToolCall] = []
        if self._NAMED.match(rest):
            decoder = json.JSONDecoder()
            for match in self._NAMED.finditer(rest):
                try:
                    args, _ = decoder.raw_decode(rest, match.end())
                except json.JSONDecodeError:
                    continue
                calls += [c for c in [call_from_json({"name": match.group(1), "arguments": args})] if c]
        else:
            payload = _loads(rest.removeprefix("[TOOL_CALLS]").strip())
            items = payload if isinstance(payload, list) else [payload]
            calls = [c for item in items if (c := call_from_json(item))]
        return (text[:start].strip(), calls) if calls else (text, [])


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def detect_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's tool format calls for; None when the template has no tools."""
    template = chat_template or ""
    if "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(PARSERS)}")
    return PARSERS[name]()
