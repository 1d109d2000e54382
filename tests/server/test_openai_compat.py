"""Real clients against a live `tokenforge serve` (bundled SmolLM2, CPU): the openai SDK (sync,
async, streaming) and LangChain's ChatOpenAI, through structured outputs, tool calling, echo with
logprobs (as evaluation harnesses score) and the routes around them."""

from __future__ import annotations

import asyncio
import json
import math
import sys

import httpx
import jsonschema
import openai
import pytest

from .servers import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-compat"
SERVE = [sys.executable, "-m", "tokenforge.cli", "serve", "--device", "cpu", "--max-num-seqs", "16",
         "--num-kv-blocks", "512", "--enable-access-log"]

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "location": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                     "required": ["lat", "lon"], "additionalProperties": False}},
        "required": ["city", "location"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"colors": {"type": "array", "minItems": 1, "maxItems": 3,
                                                          "items": {"type": "string", "maxLength": 12}}},
              "required": ["colors"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                              "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
             "required": ["sentiment"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                                  "year": {"type": "integer"},
                                                  "tags": {"type": "array", "maxItems": 2,
                                                           "items": {"type": "string", "maxLength": 10}}},
                 "required": ["title"], "additionalProperties": False},
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}},
                   "required": ["timezone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
TOOL_PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def live():
    server = ServerProcess(SERVE, api_key=KEY)
    server.wait_healthy(600)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def aclient(live):
    """A factory: an async client is bound to the event loop it first runs in (one per asyncio.run)."""
    return lambda: openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0)


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_structured_outputs_parse_and_validate(aclient):
    """Every schema shape, json_schema and json_object, a mixed constrained/free batch: 100% valid."""
    client = None

    async def one(name: str, schema: dict, seed: int):
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        out = await client.chat.completions.create(
            model=MODEL, messages=_ask(f"Give an example {name} as JSON."), response_format=fmt,
            max_tokens=120, temperature=0.7, seed=seed)
        return name, out.choices[0]

    async def free():
        return await client.chat.completions.create(model=MODEL, messages=_ask("Say hi."), max_tokens=8)

    async def run():
        nonlocal client
        client = aclient()
        jobs = [one(n, s, seed) for seed in (1, 2) for n, s in SCHEMAS.items()]
        object_job = client.chat.completions.create(model=MODEL, messages=_ask("A JSON object about a cat."),
                                                     response_format={"type": "json_object"}, max_tokens=120,
                                                     temperature=0)
        return await asyncio.gather(*jobs, object_job, free())

    *results, any_object, plain = asyncio.run(run())
    for name, choice in results:
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
    # json_object bounds nothing, so a small model may run to max_tokens; a finished one parses.
    text = any_object.choices[0].message.content
    assert text.startswith("{")
    if any_object.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert plain.choices[0].message.content


def test_guided_fields_on_completions(client):
    choice = client.completions.create(model=MODEL, prompt="Is water wet? Answer:", max_tokens=5,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    regex = client.completions.create(model=MODEL, prompt="A phone number:", max_tokens=12,
                                      extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert len(regex.choices[0].text) == 8 and regex.choices[0].text[3] == "-"
    grammar = 'root ::= "The answer is " [0-9]+ "."'
    out = client.completions.create(model=MODEL, prompt="What is 2+2?", max_tokens=12, temperature=0,
                                    extra_body={"guided_grammar": grammar})
    assert out.choices[0].text.startswith("The answer is ") and out.choices[0].text.endswith(".")


def _check_calls(calls, allowed=TOOL_PARAMS) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name])


def test_tool_choice_required_always_parses(aclient):
    questions = ["What's the weather in Paris?", "What time is it in Tokyo?", "Is it raining in Oslo?",
                 "Tell me a joke.", "Weather in Rome in fahrenheit?", "Time in UTC please."]

    async def run():
        client = aclient()
        return await asyncio.gather(*[client.chat.completions.create(
            model=MODEL, messages=_ask(q), tools=TOOLS, tool_choice="required", max_tokens=100, temperature=0.8,
            seed=i, parallel_tool_calls=i % 2 == 0) for i, q in enumerate(questions)])

    for i, out in enumerate(asyncio.run(run())):
        choice = out.choices[0]
        # A small model may list parallel calls until max_tokens: the whole ones still parse.
        assert choice.finish_reason == ("tool_calls" if i % 2 else choice.finish_reason), choice.message
        _check_calls(choice.message.tool_calls)
        assert i % 2 == 0 or len(choice.message.tool_calls) == 1


def test_named_tool_streaming_and_round_trip(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=_ask("Weather in Berlin?"), tools=TOOLS, tool_choice=named, max_tokens=60,
        temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1
    call = deltas[0].tool_calls[0]
    assert call.index == 0 and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The call and its result go back in; the model answers in text.
    history = [*_ask("Weather in Berlin?"),
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=30,
                                            temperature=0)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    none = client.chat.completions.create(model=MODEL, messages=_ask("Weather in Berlin?"), tools=TOOLS,
                                          tool_choice="none", max_tokens=10, temperature=0)
    assert none.choices[0].message.tool_calls is None


def test_echo_logprobs_match_offline_prompt_logprobs(client, live):
    from tokenforge import LLM, SamplingParams

    prompt = "The quick brown fox jumps over the lazy dog"
    out = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=1,
                                    temperature=0)
    lp = out.choices[0].logprobs
    llm = LLM(max_num_seqs=2, num_kv_blocks=32)
    offline = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1),
                           use_tqdm=False)[0]
    ids = offline.prompt_token_ids
    assert out.choices[0].text.startswith(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.text_offset[0] == 0
    for got, position, token_id in zip(lp.token_logprobs[1:len(ids)], offline.prompt_logprobs[1:], ids[1:]):
        assert math.isclose(got, position[token_id].logprob, abs_tol=1e-4)
    zero = client.completions.create(model=MODEL, prompt=[ids], echo=True, logprobs=0, max_tokens=0)
    assert zero.choices[0].text == prompt and zero.usage.completion_tokens == 0
    assert all(math.isclose(a, b, abs_tol=1e-4)
               for a, b in zip(zero.choices[0].logprobs.token_logprobs[1:], lp.token_logprobs[1:len(ids)], strict=True))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}
    raw = httpx.post(live.url + "/v1/completions", json=body, headers=live.headers).json()
    entries = raw["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    assert math.isclose(entries[1][str(ids[1])]["logprob"], offline.prompt_logprobs[1][ids[1]].logprob, abs_tol=1e-4)
    # chat: vLLM's top-level prompt_logprobs, over the prompt as the template rendered it
    messages = [{"role": "user", "content": prompt}]
    chat_ids = httpx.post(live.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    body = {"model": MODEL, "messages": messages, "max_tokens": 1, "prompt_logprobs": 0}
    chat = httpx.post(live.url + "/v1/chat/completions", json=body, headers=live.headers).json()
    want = llm.generate([{"prompt_token_ids": chat_ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)[0].prompt_logprobs
    got = chat["prompt_logprobs"]
    assert got[0] is None and len(got) == len(chat_ids) == chat["usage"]["prompt_tokens"]
    for entry, position, token_id in zip(got[1:], want[1:], chat_ids[1:], strict=True):
        assert list(entry) == [str(token_id)]
        assert math.isclose(entry[str(token_id)]["logprob"], position[token_id].logprob, abs_tol=1e-4)


def _token_ids(live, text: str) -> list[int]:
    reply = httpx.post(live.url + "/tokenize", json={"prompt": text, "add_special_tokens": False})
    return reply.json()["tokens"]


def test_logit_bias_bans_and_forces_tokens(client, live):
    """OpenAI's logit_bias through the SDK: -100 bans the greedy continuation's first token (on the
    completions and chat routes), +100 on one token makes every sampled token that token."""
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0).choices[0].text
    first = _token_ids(live, plain)[0]
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={str(first): -100}).choices[0].text
    assert _token_ids(live, banned)[0] != first and banned != plain
    forced_id = _token_ids(live, " Paris")[0]
    forced = client.chat.completions.create(model=MODEL, messages=_ask("Say hello."), max_tokens=5,
                                            temperature=1.0, seed=3, logit_bias={str(forced_id): 100})
    assert _token_ids(live, forced.choices[0].message.content) == [forced_id] * 5


def test_tokenizer_info_and_open_routes(live):
    info = httpx.get(live.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"] and info["tokenizer_class"]
    assert httpx.post(live.url + "/tokenize", json={"prompt": "Hi", "add_special_tokens": False}).status_code == 200
    assert httpx.post(live.url + "/v1/completions", json={"prompt": "Hi"}).status_code == 401


def test_langchain_chat_openai(live):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    chat = ChatOpenAI(model=MODEL, base_url=live.url + "/v1", api_key=KEY, max_tokens=24, temperature=0,
                      max_retries=0)
    assert chat.invoke("Say hello.").content
    assert "".join(chunk.content for chunk in chat.stream("Count to three.")).strip()
    assert all(m.content for m in chat.batch(["Name a fruit.", "Name a color."]))

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)

    city = chat.with_structured_output(City).invoke("Name a city in Japan.")
    assert isinstance(city, City) and city.name

    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"sunny in {city}"

    agent = chat.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False).bind(max_tokens=60)
    messages = [HumanMessage("What's the weather in Paris?")]
    reply = agent.invoke(messages)
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    call = reply.tool_calls[0]
    messages += [reply, ToolMessage(get_weather(str(call["args"].get("city"))), tool_call_id=call["id"])]
    final = chat.bind_tools([get_weather]).invoke(messages)
    assert final.content or final.tool_calls
