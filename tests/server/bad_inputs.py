"""The bad-input table, shared by the fake-core and the real-model server tests.

Each case: (name, method, path, body or raw bytes, expected status, expected param or None).
Built for a server started with --max-model-len 256 (or more), --max-n 4, --max-tokens-limit 200
and --max-body-size 64KiB.
"""

from __future__ import annotations

import json

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def cases(max_model_len: int, vocab_size: int) -> list[tuple]:
    too_long = [1] * (max_model_len + 5)
    return [
        ("malformed json", "POST", COMPLETIONS, b'{"prompt": "hi",', 400, None),
        ("json array body", "POST", COMPLETIONS, b"[1, 2]", 400, None),
        ("deeply nested json", "POST", COMPLETIONS, b"[" * 30_000 + b"]" * 30_000, 400, None),
        ("missing prompt", "POST", COMPLETIONS, {"max_tokens": 3}, 400, "prompt"),
        ("empty prompt", "POST", COMPLETIONS, {"prompt": ""}, 400, "prompt"),
        ("empty prompt list", "POST", COMPLETIONS, {"prompt": []}, 400, "prompt"),
        ("token id out of vocab", "POST", COMPLETIONS, {"prompt": [1, vocab_size + 7]}, 400, "prompt"),
        ("negative token id", "POST", COMPLETIONS, {"prompt": [1, -3]}, 400, "prompt"),
        ("huge token id", "POST", COMPLETIONS, {"prompt": [2**80]}, 400, "prompt"),
        ("prompt too long", "POST", COMPLETIONS, {"prompt": too_long}, 400, "prompt"),
        ("wrong type n", "POST", COMPLETIONS, {"prompt": "hi", "n": "many"}, 400, "n"),
        ("n zero", "POST", COMPLETIONS, {"prompt": "hi", "n": 0}, 400, "n"),
        ("n above max-n", "POST", COMPLETIONS, {"prompt": "hi", "n": 5}, 400, "n"),
        ("negative temperature", "POST", COMPLETIONS, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("nan temperature", "POST", COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
        ("infinite temperature", "POST", COMPLETIONS, b'{"prompt": "hi", "temperature": Infinity}', 400,
         "temperature"),
        ("top_p zero", "POST", COMPLETIONS, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ("top_k below -1", "POST", COMPLETIONS, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
        ("min_p above 1", "POST", COMPLETIONS, {"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
        ("presence penalty above 2", "POST", COMPLETIONS, {"prompt": "hi", "presence_penalty": 3}, 400,
         "presence_penalty"),
        ("repetition penalty zero", "POST", COMPLETIONS, {"prompt": "hi", "repetition_penalty": 0}, 400,
         "repetition_penalty"),
        ("logprobs above 20", "POST", COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
        ("max_tokens zero", "POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ("max_tokens above limit", "POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 201}, 400, "max_tokens"),
        ("max_tokens past the context", "POST", COMPLETIONS, {"prompt": [1] * (max_model_len - 10), "max_tokens": 11},
         400, "max_tokens"),
        ("the default max_tokens past the context", "POST", COMPLETIONS, {"prompt": [[1, 2], [1] * (max_model_len - 3)]},
         400, "max_tokens"),
        ("min_tokens above max_tokens", "POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "min_tokens": 5},
         400, "min_tokens"),
        ("empty stop string", "POST", COMPLETIONS, {"prompt": "hi", "stop": [""]}, 400, "stop"),
        ("stop token out of vocab", "POST", COMPLETIONS, {"prompt": "hi", "stop_token_ids": [vocab_size]}, 400,
         "stop_token_ids"),
        ("seed beyond 64 bits", "POST", COMPLETIONS, {"prompt": "hi", "seed": 2**70}, 400, "seed"),
        ("logit_bias key not a token id", "POST", COMPLETIONS, {"prompt": "hi", "logit_bias": {"x": 5}}, 400,
         "logit_bias"),
        ("logit_bias above 100", "POST", COMPLETIONS, {"prompt": "hi", "logit_bias": {"1": 101}}, 400, "logit_bias"),
        ("logit_bias token out of vocab", "POST", CHAT, {"messages": USER, "logit_bias": {str(vocab_size): 1}}, 400,
         "logit_bias"),
        ("unknown model", "POST", COMPLETIONS, {"prompt": "hi", "model": "gpt-17"}, 404, "model"),
        ("chat unknown model", "POST", CHAT, {"messages": USER, "model": "gpt-17"}, 404, "model"),
        ("chat no messages", "POST", CHAT, {"messages": []}, 400, "messages"),
        ("chat bad role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
        ("chat image part", "POST", CHAT,
         {"messages": [{"role": "user", "content": [
             {"type": "text", "text": "what is this?"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400, "messages"),
        ("chat audio part", "POST", CHAT,
         {"messages": [{"role": "user", "content": [
             {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}, 400, "messages"),
        ("chat request template", "POST", CHAT, {"messages": USER, "chat_template": "{{ messages }}"}, 400,
         "chat_template"),
        ("chat prompt_logprobs streamed", "POST", CHAT, {"messages": USER, "stream": True, "prompt_logprobs": 1},
         400, "prompt_logprobs"),
        ("chat reasoning_effort unknown", "POST", CHAT, {"messages": USER, "reasoning_effort": "max"}, 400,
         "reasoning_effort"),
        ("chat top_logprobs without logprobs", "POST", CHAT, {"messages": USER, "top_logprobs": 3}, 400,
         "top_logprobs"),
        ("stream_options without stream", "POST", COMPLETIONS,
         {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("chat stream_options without stream", "POST", CHAT,
         {"messages": USER, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("continue_final_message with add_generation_prompt", "POST", CHAT,
         {"messages": USER + [{"role": "assistant", "content": "Sure"}], "continue_final_message": True}, 400,
         "continue_final_message"),
        ("chat top_logprobs above 20", "POST", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21},
         400, "top_logprobs"),
        ("chat tools", "POST", CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
        ("unsupported schema feature", "POST", CHAT, {"messages": USER, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}, 400, "response_format"),
        ("schema with a dangling $ref", "POST", COMPLETIONS, {"prompt": "hi", "guided_json": {
            "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, 400, "guided_json"),
        ("response_format without schema", "POST", CHAT, {"messages": USER, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format"),
        ("response_format unknown type", "POST", CHAT, {"messages": USER, "response_format": {"type": "xml"}}, 400,
         "response_format"),
        ("grammar that fails to compile", "POST", COMPLETIONS, {"prompt": "hi", "guided_grammar": "root ::= (\"a\""},
         400, "guided_grammar"),
        ("regex that fails to compile", "POST", COMPLETIONS, {"prompt": "hi", "structured_outputs": {"regex": "a["}},
         400, "structured_outputs"),
        ("two constraints", "POST", COMPLETIONS, {"prompt": "hi", "guided_regex": "a+", "guided_choice": ["a"]}, 400,
         "guided_choice"),
        ("tool with an invalid schema", "POST", CHAT, {"messages": USER, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}]}, 400, "tools"),
        ("tool_choice names no tool", "POST", CHAT, {"messages": USER, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object"}}}], "tool_choice": {"type": "function",
                                                                               "function": {"name": "g"}}}, 400,
         "tool_choice"),
        ("tool_choice without tools", "POST", CHAT, {"messages": USER, "tool_choice": "required"}, 400, "tool_choice"),
        ("body too large", "POST", COMPLETIONS, {"prompt": "x" * 70_000}, 413, None),
        ("detokenize out of vocab", "POST", "/detokenize", {"tokens": [vocab_size]}, 400, "tokens"),
        ("tokenize nothing", "POST", "/tokenize", {}, 400, "prompt"),
        ("unknown route", "POST", "/v1/edits", {"prompt": "hi"}, 404, None),
        ("wrong method", "GET", COMPLETIONS, None, 405, None),
    ]


def encode(body) -> bytes | None:
    if body is None or isinstance(body, bytes):
        return body
    return json.dumps(body).encode()


def check_error_body(response, status: int, param) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] == param, error
