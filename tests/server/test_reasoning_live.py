"""`tokenforge serve --reasoning-parser` with the real engine on tiny random gpt-oss and Qwen3-MoE
checkpoints (CPU) through the official openai client. The output is forced with a grammar whose
terminals are the format's real special tokens (a random model never writes the format itself), so
the whole path runs: sampling, detokenization with the markers kept, the parser, the API shapes.

- gpt_oss: analysis -> reasoning_content, final -> content, streamed and not, and equal to the
  model's raw output (the same tokens through /v1/completions) split by the parser; a tool-call round
  trip (the call from the commentary channel as tool_calls, the result rendered back as a harmony
  tool message, the model answering).
- qwen3: <think> from the model, a template that pre-fills <think>, and enable_thinking=false
  through chat_template_kwargs (the template's empty block reaches the prompt).
- start-up: a parser for a model without its format, and an unknown name, are one line each,
  before the engine loads.

These servers run with --structured-outputs-in-reasoning (the forcing grammar covers the thinking);
by default a grammar constrains only the answer, after the parser's marker: the qwen3_answer server.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import openai
import pytest

from tokenforge.engine.tokenization import load_tokenizer
from tokenforge.server.reasoning import get_reasoning_parser

from .reasoning_models import QWEN3_PREFILL_TEMPLATE, format_checkpoint
from .servers import REPO, ServerProcess, free_port

pytestmark = pytest.mark.slow

SERVE = [sys.executable, "-m", "tokenforge.cli", "serve", "--device", "cpu", "--num-kv-blocks", "256",
         "--max-num-seqs", "4"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
ANSWER = ('start: <|channel|> "analysis" <|message|> "The user wants the weather. Say sunny." <|end|> '
          '<|start|> "assistant" <|channel|> "final" <|message|> "Sunny in Paris." <|return|>')
CALL = ('start: <|channel|> "analysis" <|message|> "Need the weather tool." <|end|> <|start|> "assistant" '
        '<|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|> '
        '"{\\"city\\": \\"Paris\\"}" <|call|>')
AFTER_TOOL = 'start: <|channel|> "analysis" <|message|> "It is 21." <|end|> <|start|> "assistant" ' \
             '<|channel|> "final" <|message|> "It is 21 degrees in Paris." <|return|>'


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("reasoning")
    return {kind: format_checkpoint(root / kind, kind) for kind in ("gpt_oss", "qwen3")}


@pytest.fixture(scope="module")
def harmony(checkpoints):
    server = ServerProcess([*SERVE, str(checkpoints["gpt_oss"]), "--reasoning-parser", "gpt_oss",
                            "--structured-outputs-in-reasoning"])
    server.wait_healthy(300)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def qwen3(checkpoints):
    server = ServerProcess([*SERVE, str(checkpoints["qwen3"]), "--reasoning-parser", "qwen3",
                            "--trust-request-chat-template", "--structured-outputs-in-reasoning"])
    server.wait_healthy(300)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def qwen3_answer(checkpoints):
    """The default: a grammar starts after </think>."""
    server = ServerProcess([*SERVE, str(checkpoints["qwen3"]), "--reasoning-parser", "qwen3",
                            "--trust-request-chat-template"])
    server.wait_healthy(300)
    yield server
    server.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _chat(server, grammar: str, messages=ASK, **kwargs):
    extra = {"structured_outputs": {"grammar": grammar}, **kwargs.pop("extra_body", {})}
    return _client(server).chat.completions.create(model=_client(server).models.list().data[0].id,
                                                   messages=messages, max_tokens=80, temperature=0,
                                                   extra_body=extra, **kwargs)


def _streamed(server, grammar: str, messages=ASK, **kwargs) -> tuple[list[tuple[str, str]], list, str]:
    """(the ordered (field, text) deltas, the tool-call deltas, the finish reason)."""
    parts, calls, finish = [], [], None
    for chunk in _chat(server, grammar, messages, stream=True, **kwargs):
        choice = chunk.choices[0]
        reasoning = getattr(choice.delta, "reasoning_content", None)
        parts += [("reasoning", reasoning)] if reasoning else []
        parts += [("content", choice.delta.content)] if choice.delta.content else []
        calls += choice.delta.tool_calls or []
        finish = choice.finish_reason or finish
    return parts, calls, finish


def _joined(parts, field: str) -> str:
    return "".join(text for f, text in parts if f == field)


def test_harmony_analysis_is_reasoning_and_final_is_content(harmony, checkpoints):
    message = _chat(harmony, ANSWER).choices[0].message
    assert (message.reasoning_content, message.content) == ("The user wants the weather. Say sunny.", "Sunny in Paris.")
    parts, calls, finish = _streamed(harmony, ANSWER)
    assert [f for f, _ in parts] == sorted((f for f, _ in parts), key=["reasoning", "content"].index)
    assert len(parts) > 4 and not calls and finish == "stop"        # deltas, reasoning first, then content
    assert (_joined(parts, "reasoning"), _joined(parts, "content")) == (message.reasoning_content, message.content)
    # The same tokens, raw: the chat answer is exactly their split.
    tokenizer = load_tokenizer(checkpoints["gpt_oss"])
    prompt = tokenizer.apply_chat_template(ASK)
    raw = _client(harmony).completions.create(
        model=_client(harmony).models.list().data[0].id, prompt=tokenizer.encode(prompt, add_special_tokens=False),
        max_tokens=80, temperature=0, extra_body={"structured_outputs": {"grammar": ANSWER},
                                                  "skip_special_tokens": False}).choices[0].text
    assert raw.startswith("<|channel|>analysis<|message|>") and raw.endswith("<|return|>")
    split = get_reasoning_parser("gpt_oss", tokenizer).parse(prompt, raw)
    assert (split.reasoning, split.content) == (message.reasoning_content, message.content)


def test_reasoning_effort_reaches_the_template(harmony, checkpoints):
    """OpenAI's `reasoning_effort` is the template's `reasoning_effort` (gpt-oss's system message);
    chat_template_kwargs that set it win. The prompt as served, read back from its prompt_logprobs."""
    def system_line(**body) -> str:
        reply = httpx.post(harmony.url + "/v1/chat/completions", json={
            "messages": ASK, "max_tokens": 1, "prompt_logprobs": 0, **body}).json()
        ids = [int(next(iter(entry))) for entry in reply["prompt_logprobs"][1:]]
        text = httpx.post(harmony.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
        return re.search(r"Reasoning: (\w+)", text).group(1)

    assert system_line() == "medium"
    assert system_line(reasoning_effort="high") == "high"
    assert system_line(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}) == "high"
    bad = httpx.post(harmony.url + "/v1/chat/completions", json={"messages": ASK, "reasoning_effort": "max"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"


def test_harmony_tool_call_round_trip(harmony, checkpoints):
    first = _chat(harmony, CALL, tools=[WEATHER]).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    assert first.message.reasoning_content == "Need the weather tool."
    (call,) = first.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    parts, calls, finish = _streamed(harmony, CALL, tools=[WEATHER])
    assert finish == "tool_calls" and _joined(parts, "reasoning") == "Need the weather tool."
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [(0, "get_weather", '{"city": "Paris"}')]
    # The client runs the tool and sends the result back; the model continues from it.
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    second = _chat(harmony, AFTER_TOOL, history, tools=[WEATHER]).choices[0]
    assert second.finish_reason == "stop" and not second.message.tool_calls
    assert (second.message.reasoning_content, second.message.content) == ("It is 21.", "It is 21 degrees in Paris.")
    tokenizer = load_tokenizer(checkpoints["gpt_oss"])
    rendered = tokenizer.apply_chat_template([*ASK, history[1] | {"tool_calls": [
        {**call.model_dump(), "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, history[2]])
    assert rendered.endswith('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
                             '<|message|>{"city": "Paris"}<|call|><|start|>functions.get_weather to=assistant'
                             '<|channel|>commentary<|message|>{"temperature": 21}<|end|><|start|>assistant')


def test_harmony_without_tools_in_the_request_and_unconstrained(harmony):
    """A call the client did not offer tools for is not returned; an unconstrained random answer
    still comes back (as content: it has no harmony headers)."""
    message = _chat(harmony, CALL).choices[0].message
    assert message.tool_calls is None and message.reasoning_content == "Need the weather tool."
    free = _client(harmony).chat.completions.create(model=_client(harmony).models.list().data[0].id, messages=ASK,
                                                    max_tokens=8, temperature=0).choices[0]
    assert free.finish_reason in ("stop", "length") and isinstance(free.message.content or "", str)


def _think_ids(checkpoints) -> tuple[int, int]:
    """<think> and </think> by id in a grammar: written as text, llguidance's forced bytes would
    become the added token, which its vocabulary marks special, and the constraint would fail."""
    tokenizer = load_tokenizer(checkpoints["qwen3"])
    (start,), (end,) = (tokenizer.encode(t, add_special_tokens=False) for t in ("<think>", "</think>"))
    return start, end


def test_qwen3_think_tags(qwen3, checkpoints):
    start, end = _think_ids(checkpoints)
    grammar = f'start: <[{start}]> "\\n" "Two and two make four." "\\n" <[{end}]> "\\n\\n" "The answer is 4."'
    message = _chat(qwen3, grammar).choices[0].message
    assert (message.reasoning_content, message.content) == ("Two and two make four.", "The answer is 4.")
    parts, _, finish = _streamed(qwen3, grammar)
    assert finish == "stop" and [f for f, _ in parts][:1] == ["reasoning"] and parts[-1][0] == "content"
    assert (_joined(parts, "reasoning"), _joined(parts, "content")) == (message.reasoning_content, message.content)


def test_qwen3_thinking_then_a_hermes_tool_call(qwen3, checkpoints):
    """The reasoning parser runs first; the tool-call parser reads the content after </think>."""
    start, end = _think_ids(checkpoints)
    grammar = (f'start: <[{start}]> "Use the tool." <[{end}]> "\\n<tool_call>\\n" '
               '"{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Paris\\"}}" "\\n</tool_call>"')
    choice = _chat(qwen3, grammar, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "Use the tool."
    assert choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    parts, calls, finish = _streamed(qwen3, grammar, tools=[WEATHER])
    assert finish == "tool_calls" and (_joined(parts, "reasoning"), _joined(parts, "content")) == ("Use the tool.", "")
    assert [c.function.name for c in calls] == ["get_weather"]


def test_qwen3_prefilled_think_and_enable_thinking_false(qwen3, checkpoints):
    grammar = f'start: "Two and two." "\\n" <[{_think_ids(checkpoints)[1]}]> "\\n\\n" "Four."'
    prefilled = _chat(qwen3, grammar, extra_body={"chat_template": QWEN3_PREFILL_TEMPLATE}).choices[0].message
    assert (prefilled.reasoning_content, prefilled.content) == ("Two and two.", "Four.")
    on = _chat(qwen3, 'start: "Four."')
    off = _chat(qwen3, 'start: "Four."', extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert (off.choices[0].message.reasoning_content, off.choices[0].message.content) == (None, "Four.")
    tokenizer = load_tokenizer(checkpoints["qwen3"])
    block = len(tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + block        # the template got the kwarg


ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
                 "required": ["answer"], "additionalProperties": False}


def test_by_default_a_schema_constrains_only_the_answer(qwen3_answer, checkpoints):
    """A template that opens <think>: the thinking runs free (a random model never closes it, so the
    schema never starts and the reply is all reasoning); +100 on </think> closes it at once, and the
    answer after it follows the schema, streamed or not; with the block closed in the prompt
    (enable_thinking=false) the schema holds from the first token."""
    end = _think_ids(checkpoints)[1]
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}}
    client, prefill = _client(qwen3_answer), {"chat_template": QWEN3_PREFILL_TEMPLATE}
    model = client.models.list().data[0].id
    free = client.chat.completions.create(model=model, messages=ASK, max_tokens=12, temperature=1.0, seed=1,
                                          response_format=fmt, extra_body=prefill).choices[0]
    assert free.finish_reason == "length" and free.message.content is None
    assert free.message.reasoning_content and not free.message.reasoning_content.startswith("{")
    closed = client.chat.completions.create(model=model, messages=ASK, max_tokens=40, temperature=0,
                                            response_format=fmt, logit_bias={str(end): 100}, extra_body=prefill)
    message = closed.choices[0].message
    assert closed.choices[0].finish_reason == "stop" and message.reasoning_content is None
    assert set(json.loads(message.content)) == {"answer"} and isinstance(json.loads(message.content)["answer"], int)
    chunks = client.chat.completions.create(model=model, messages=ASK, max_tokens=40, temperature=0, stream=True,
                                            response_format=fmt, logit_bias={str(end): 100}, extra_body=prefill)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    off = client.chat.completions.create(model=model, messages=ASK, max_tokens=40, temperature=0, response_format=fmt,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].finish_reason == "stop" and set(json.loads(off.choices[0].message.content)) == {"answer"}


def test_answer_markers(checkpoints):
    """Each parser's marker: qwen3 `</think>` (none once the prompt closed the block), gpt_oss the
    final channel's header (none once the prompt opened the final message)."""
    qwen3 = load_tokenizer(checkpoints["qwen3"])
    parser = get_reasoning_parser("qwen3", qwen3)
    assert parser.answer_marker("<|im_start|>assistant\n") == qwen3.encode("</think>", add_special_tokens=False)
    assert parser.answer_marker("<|im_start|>assistant\n<think>\n\n</think>\n\n") is None
    harmony = load_tokenizer(checkpoints["gpt_oss"])
    parser = get_reasoning_parser("gpt_oss", harmony)
    marker = parser.answer_marker("<|start|>assistant")
    assert marker == harmony.encode("<|channel|>final<|message|>", add_special_tokens=False) and len(marker) == 3
    assert parser.answer_marker("<|start|>assistant<|channel|>final<|message|>") is None


def _serve_fails(*argv: str) -> tuple[int, str]:
    out = subprocess.run([*SERVE, *argv, "--port", str(free_port())], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    return out.returncode, out.stderr


@pytest.mark.parametrize("parser,model,missing", [
    ("gpt_oss", None, "<|start|> / <|channel|> / <|message|> / <|end|> tokens"),
    ("qwen3", None, "<think> / </think> tokens"),
    ("gpt_oss", "qwen3", "<|start|> / <|channel|> / <|message|> / <|end|> tokens"),
    ("qwen3", "gpt_oss", "<think> / </think> tokens")])
def test_a_parser_for_a_model_without_its_format_is_one_line(checkpoints, parser, model, missing):
    """The bundled SmolLM2 (a Llama; a GGUF, whose tokenizer the check loads for the engine) speaks
    neither format, and each tiny checkpoint (an HF directory, read with `tokenizers` alone) only its
    own: refused before the weights load."""
    code, err = _serve_fails(*([str(checkpoints[model])] if model else []), "--reasoning-parser", parser)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"tokenforge: error: --reasoning-parser {parser}: the model's tokenizer has no "
                                f"{missing}, so this model does not speak "), err
    assert "Traceback" not in err and "engine core ready" not in err and "start-up:" not in err


def test_an_unknown_parser_lists_the_choices():
    code, err = _serve_fails("--reasoning-parser", "deepseek_r1")
    assert code == 2
    assert re.match(r"tokenforge serve: error: argument --reasoning-parser: invalid choice: 'deepseek_r1' "
                    r"\(choose from '?gpt_oss'?, '?qwen3'?\)\n", err), err     # quotes: as the Python version writes them
