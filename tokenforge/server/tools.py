"""Tool calling for /v1/chat/completions: validate `tools` and `tool_choice`, build the prompt,
constrain `required` and named choices with the grammar engine, and turn the output into calls.

- `auto`: the tools go to the chat template; the parser (`--tool-call-parser`, or the one the
  template's format calls for) finds the calls in the free text.
- `required` / a named function: the output is constrained by a JSON schema, so it always parses:
  a list of `{"name", "arguments"}` (one item when parallel_tool_calls is false), or that one
  function's arguments.
- `none`: the tools are left out of the prompt and the answer is plain text.

Templates without tool support (the bundled SmolLM2's) get the tool definitions in the system
message, Hermes style (`TOOL_PROMPT`); earlier calls and results are written into the
conversation the same way, so multi-turn tool use round-trips on any template.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from tokenforge.sampling_params import StructuredOutputsParams
from tokenforge.server.errors import bad_request
from tokenforge.server.tool_parsers import ToolCall, ToolParser, call_from_json, detect_parser, get_parser

_NAME = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
_EMPTY_PARAMS = {"type": "object", "properties": {}}

TOOL_PROMPT = (
    "You can call functions. These are the functions available, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with one block per call, each a JSON object with the function's name and "
    "arguments:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <arguments-object>}}\n</tool_call>")


@dataclass(slots=True)
class ToolSetup:
    tools: list[dict]                          # validated {"type": "function", "function": {...}}
    mode: str                                  # none | auto | required | named
    named: str | None = None                   # the function of a named tool_choice
    parallel: bool = True
    parser: ToolParser | None = None           # for auto
    schemas: dict[str, dict] = field(default_factory=dict)   # name -> parameters schema

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")

    @property
    def in_prompt(self) -> list[dict] | None:
        return self.tools if self.tools and self.mode != "none" else None


def tool_setup(tools: list | None, tool_choice, parallel: bool, parser_name: str | None,
               chat_template: str | None) -> ToolSetup | None:
    """Validate the request's tools and choice (400 naming the field); None without tools."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    validated, schemas = [], {}
    for i, tool in enumerate(tools):
        entry = _validate_tool(i, tool)
        validated.append(entry)
        schemas[entry["function"]["name"]] = entry["function"]["parameters"]
    mode, named = _choice(tool_choice, schemas)
    name = parser_name or detect_parser(chat_template) or "hermes"
    return ToolSetup(validated, mode, named, parallel, get_parser(name), schemas)


def _validate_tool(i: int, tool) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(f"{where} must be {{'type': 'function', 'function': {{...}}}}", param="tools")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                          param="tools")
    params = fn.get("parameters", _EMPTY_PARAMS)
    if not isinstance(params, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object", param="tools")
    out = {"name": name, "parameters": params}
    if isinstance(fn.get("description"), str):
        out["description"] = fn["description"]
    return {"type": "function", "function": out}


def _choice(tool_choice, schemas: dict[str, dict]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in schemas:
            raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools "
                              f"{sorted(schemas)}", param="tool_choice")
        return "named", name
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                      "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")


def tool_constraints(setup: ToolSetup) -> list[tuple[str, StructuredOutputsParams]]:
    """Every schema the request needs compiled: each tool's parameters (to refuse a bad one with
    400), then the output constraint for required / named (last; None for auto)."""
    out = [(f"tools[{i}].function.parameters", StructuredOutputsParams(json=t["function"]["parameters"]))
           for i, t in enumerate(setup.tools)]
    if setup.mode == "named":
        out.append(("tool_choice", StructuredOutputsParams(json=setup.schemas[setup.named])))
    elif setup.mode == "required":
        items = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, schema in setup.schemas.items()]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not setup.parallel:
            array["maxItems"] = 1
        out.append(("tool_choice", StructuredOutputsParams(json=array)))
    return out


def extract_calls(setup: ToolSetup, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished answer."""
    if setup.mode == "named":
        parsed = _loads(text)
        return (None, [ToolCall(setup.named, json.dumps(parsed, ensure_ascii=False))]) if parsed is not None \
            else (text, [])
    if setup.mode == "required":
        calls = [c for item in _array_items(text) if (c := call_from_json(item))]
        return (None, calls) if calls else (text, [])
    if setup.mode == "auto" and setup.parser is not None:
        content, calls = setup.parser.parse(text)
        return (content or None, calls) if calls else (text, [])
    return text, []


def _array_items(text: str) -> list:
    """The complete items of a JSON array, also of one cut off by max_tokens: the grammar keeps
    the text a valid prefix, so every item before the cut is a whole, valid call."""
    decoder, items = json.JSONDecoder(), []
    pos = text.find("[") + 1
    while 0 < pos < len(text):
        while pos < len(text) and text[pos] in " \n\t,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        items.append(item)
    return items


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


# ---- the prompt ------------------------------------------------------------------------------------

def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def with_tool_prompt(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """For templates without tools: tool definitions into the system message; earlier calls and
    results written into the text in the same Hermes format."""
    out = [_flatten_tool_turn(m) for m in messages]
    if not tools:
        return out
    text = TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def _flatten_tool_turn(message: dict) -> dict:
    calls = message.get("tool_calls")
    if message["role"] == "assistant" and calls:
        blocks = [f"<tool_call>\n{json.dumps(_call_body(c), ensure_ascii=False)}\n</tool_call>" for c in calls]
        content = "\n".join(filter(None, [message.get("content") or "", *blocks]))
        return {"role": "assistant", "content": content}
    if message["role"] == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
    return {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}


def _call_body(call: dict) -> dict:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    return {"name": fn.get("name"), "arguments": _loads(args) if isinstance(args, str) else args}


def for_tool_template(messages: list[dict]) -> list[dict]:
    """For templates with tools: arguments as objects, as HF templates render them."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{"id": c.get("id"), "type": "function", "function": _call_body(c)} for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out
