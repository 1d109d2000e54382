"""Tool-call parsers, parser detection, tool validation and the required/named constraints:
pure functions, no model."""

from __future__ import annotations

import json

import pytest

from tokenforge.server.errors import APIError
from tokenforge.server.tool_parsers import detect_parser, get_parser
from tokenforge.server.tools import extract_calls, tool_constraints, tool_setup, with_tool_prompt

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_hermes():
    content, calls = get_parser("hermes").parse(
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>')
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                   ("get_weather", {"city": "Rome"})]
    assert get_parser("hermes").parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def test_llama3_json():
    content, calls = get_parser("llama3_json").parse(
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("a", '{"x": 1}'), ("b", "{}")]
    assert get_parser("llama3_json").parse("Paris is the capital.") == ("Paris is the capital.", [])


def test_mistral():
    content, calls = get_parser("mistral").parse('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 2}}]')
    assert content == "" and calls[0].name == "f" and json.loads(calls[0].arguments) == {"a": 2}
    _, calls = get_parser("mistral").parse('[TOOL_CALLS]f[ARGS]{"a": 3}')
    assert calls[0].name == "f" and json.loads(calls[0].arguments) == {"a": 3}


def test_detection():
    assert detect_parser("{{ messages }}") is None
    assert detect_parser("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_parser("{% if tools %}[TOOL_CALLS]{% endif %}") == "mistral"
    assert detect_parser("{% if tools %}<|python_tag|>{% endif %}") == "llama3_json"


def test_required_and_named_constraints_and_extraction():
    setup = tool_setup([WEATHER], "required", False, None, None)
    *_, (param, spec) = tool_constraints(setup)
    assert param == "tool_choice" and spec.json["maxItems"] == 1 and spec.json["minItems"] == 1
    content, calls = extract_calls(setup, '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert content is None and calls[0].name == "get_weather"
    # Cut off by max_tokens after one whole call: that call still comes out.
    cut = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_weather", "argu'
    assert [c.arguments for c in extract_calls(setup, cut)[1]] == ['{"city": "Oslo"}']
    named = tool_setup([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, True, None, None)
    assert tool_constraints(named)[-1][1].json == WEATHER["function"]["parameters"]
    assert extract_calls(named, '{"city": "Oslo"}')[1][0].arguments == '{"city": "Oslo"}'


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "function"}], None, "tools"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tools(tools, choice, param):
    with pytest.raises(APIError) as err:
        tool_setup(tools, choice, True, None, None)
    assert err.value.status == 400 and err.value.param == param


def test_tool_prompt_for_templates_without_tools():
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "X"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out = with_tool_prompt(messages, [WEATHER])
    assert out[0]["role"] == "system" and '"get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "X"}}\n</tool_call>'
    assert out[3] == {"role": "tool", "content": "<tool_response>\nsunny\n</tool_response>"}
