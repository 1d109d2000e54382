"""`tokenforge serve` with the real engine and the bundled SmolLM2 on CPU, through the official
openai client and raw HTTP: output equals the offline LLM, SSE format, bad inputs, concurrency
with disconnects, auth, tenant-salted prefix cache, SIGTERM drain, engine death, bench serve."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
from argparse import Namespace

import httpx
import openai
import pytest

from .bad_inputs import cases, check_error_body, encode
from .servers import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY, OTHER_KEY = "sk-live", "sk-other-tenant"
SERVE = [sys.executable, "-m", "tokenforge.cli", "serve", "--device", "cpu", "--max-n", "4",
         "--max-tokens-limit", "200", "--max-body-size", "64KiB"]
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


def start(*flags: str, api_key: str | None = None) -> ServerProcess:
    server = ServerProcess([*SERVE, *flags], api_key=api_key)
    server.wait_healthy(180)
    return server


@pytest.fixture(scope="module")
def live():
    server = start("--max-num-seqs", "16", "--num-kv-blocks", "256", "--api-key", OTHER_KEY, api_key=KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def llm():
    from tokenforge import LLM

    return LLM(max_num_seqs=4, num_kv_blocks=64)


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0)


def metric(server, name: str, key: str = KEY) -> float:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {key}"}).text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_greedy_matches_offline_and_streaming(client, llm):
    from tokenforge import SamplingParams

    offline = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert done.choices[0].text == offline.outputs[0].text
    assert done.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert done.usage.completion_tokens == len(offline.outputs[0].token_ids)
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == done.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens

    offline_chat = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=20, temperature=0)
    assert chat.choices[0].message.content == offline_chat.outputs[0].text
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(offline_chat.prompt_token_ids)
    stream = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0,
                                                 stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == chat.choices[0].finish_reason


def test_continue_final_message_continues_the_assistant_turn(client, llm, hf_gguf_tokenizer):
    """continue_final_message (vLLM's): the prompt ends where the assistant's partial answer does,
    as HF's apply_chat_template(continue_final_message=True) renders it, and greedy output is the
    offline model's continuation of exactly that prompt."""
    from tokenforge import SamplingParams

    messages = [{"role": "user", "content": "Name the capital of France."},
                {"role": "assistant", "content": "The capital of France is"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                         extra_body={"continue_final_message": True, "add_generation_prompt": False})
    text = hf_gguf_tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("The capital of France is")
    ids = hf_gguf_tokenizer.encode(text, add_special_tokens=False)
    assert out.usage.prompt_tokens == len(ids)
    offline = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=6))[0]
    assert out.choices[0].message.content == offline.outputs[0].text


def test_n_stop_seed_logprobs(client):
    two = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_tokens=8, temperature=1.0, seed=7)
    assert [c.index for c in two.choices] == [0, 1]
    assert 2 <= two.usage.completion_tokens <= 16
    again = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_tokens=8, temperature=1.0, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in two.choices]

    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = full.strip().split()[1]
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == full[:full.index(stop)]

    lp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                        top_logprobs=3)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-4)  # greedy
        assert entry.logprob <= 0
    legacy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    assert "".join(legacy.choices[0].logprobs.tokens) == legacy.choices[0].text
    assert all(len(top) >= 2 for top in legacy.choices[0].logprobs.top_logprobs)


def test_bad_inputs_then_healthy(live, client):
    model = httpx.get(live.url + "/v1/models", headers=live.headers).json()["data"][0]
    assert model["id"] == MODEL
    for name, method, path, body, status, param in cases(model["max_model_len"], 49152):
        response = httpx.request(method, live.url + path, content=encode(body), timeout=60,
                                 headers={**live.headers, "Content-Type": "application/json"})
        check_error_body(response, status, param)
        if name == "prompt too long":
            message = response.json()["error"]["message"]
            assert str(model["max_model_len"] + 5) in message and str(model["max_model_len"]) in message
        if name == "chat image part":
            assert "accepts text only" in response.json()["error"]["message"]
    assert httpx.get(live.url + "/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].text


def test_auth_and_tenant_salted_prefix_cache(live):
    check_error_body(httpx.get(live.url + "/v1/models"), 401, None)
    check_error_body(httpx.get(live.url + "/v1/models", headers={"Authorization": "Bearer sk-nope"}), 401, None)
    assert httpx.get(live.url + "/v1/models", headers=live.headers).status_code == 200
    prompt = "A shared system prompt that is long enough to fill two whole KV blocks of sixteen tokens each. " * 2

    def hits_after(key: str) -> float:
        openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0).completions.create(
            model=MODEL, prompt=prompt, max_tokens=1)
        return metric(live, "tokenforge:prefix_cache_hits_total")

    first = hits_after(KEY)
    second = hits_after(KEY)
    assert second > first                          # the same tenant reuses its cached prefix
    assert hits_after(OTHER_KEY) == second         # another tenant does not see it


def test_concurrent_streams_with_disconnects(live):
    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str | None]:
        body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 10, "ignore_eos": True,
                "stream": True, "temperature": 0.7, "seed": i}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return r.status_code, None
            finish, seen = None, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                seen += 1
                if i % 3 == 0 and seen >= 3:
                    return r.status_code, "dropped"
                finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
            return r.status_code, finish

    async def run() -> list:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=live.url, headers=live.headers, timeout=600, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(50)))

    results = asyncio.run(run())
    assert all(status == 200 for status, _ in results), results
    assert [f for _, f in results].count("dropped") == 17
    assert all(f == "length" for i, (_, f) in enumerate(results) if i % 3), results
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and metric(live, "tokenforge:num_requests_running") > 0:
        time.sleep(0.1)
    assert metric(live, "tokenforge:num_requests_running") == 0
    assert metric(live, "tokenforge:num_requests_waiting") == 0
    assert metric(live, "tokenforge:kv_cache_usage_perc") == 0
    assert metric(live, "tokenforge:request_success_total") >= 33


def test_bench_serve_smoke(live, capsys, tmp_path):
    from tokenforge.bench.serving.serve import Load, main

    args = Namespace(url=live.url, api_key=KEY, model=None, num_prompts=4, request_rate=8.0, input_len=40,
                     output_len=6, seed=None, warm_up_max_burst=4)     # bursts of 1, 2, 4: CPU time
    assert Load.from_args(args).seed != Load.from_args(args).seed      # fresh prompts per run
    args.seed = 12345
    first = main(args)
    args.results_dir = str(tmp_path)
    again = main(args)
    saved = json.loads(next(tmp_path.glob("*W4*.json")).read_text())
    assert saved["workload"] == "W4" and saved["completed"] == 4 and saved["variant"] == "rate-8"
    for result in (first, again):
        assert result["completed"] == 4 and result["failed"] == 0
        assert result["output_tokens"] == 4 * 6
        assert result["ttft_ms"]["p50"] > 0 and result["output_tok_per_s"] > 0
    assert first["prefix_hit_rate"] == 0.0          # the warm-up used other prompts than the timed run
    assert again["prefix_hit_rate"] >= 0.5          # the same seed replays: two of 2.5 blocks cached
    assert "TTFT" in capsys.readouterr().out


def test_sigterm_finishes_in_flight_stream():
    server = start("--max-num-seqs", "4", "--num-kv-blocks", "64", "--shutdown-timeout", "120")
    try:
        body = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            try:
                late = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=5).status_code
            except httpx.HTTPError:
                late = "refused"
            assert late in (503, "refused")
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(60) == 0
    finally:
        server.stop()


def test_engine_death_is_503_and_nonzero_exit():
    server = start("--max-num-seqs", "4", "--num-kv-blocks", "64")
    try:
        os.kill(server.engine_pid(), signal.SIGKILL)
        killed = time.monotonic()
        status = 200
        while status == 200 and time.monotonic() - killed < 30:       # a bound on a hang, not a speed target
            try:
                status = httpx.get(server.url + "/health", timeout=1).status_code
            except httpx.HTTPError:
                status = "gone"
        assert status in (503, "gone")
        assert server.proc.wait(30) != 0
    finally:
        server.stop()
