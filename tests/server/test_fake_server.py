"""The HTTP edge, transport and lifecycle against a live server whose engine core is a fake
(fakes.py): fast, deterministic, and independent of the model."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
import openai
import pytest

from .bad_inputs import cases, check_error_body, encode
from .fakes import VOCAB
from .servers import fake_server


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key or "none", max_retries=0)


def _until(condition, timeout: float = 30.0) -> None:
    """Poll until condition() holds or the deadline passes (a loaded machine may take seconds to
    deliver what an idle one does in milliseconds); the caller's assert then says what failed."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", headers=server.headers).text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


@pytest.mark.parametrize("case", cases(256, VOCAB), ids=lambda c: c[0])
def test_bad_input(fake, case):
    _, method, path, body, status, param = case
    headers = {**fake.headers, "Content-Type": "application/json"}
    response = httpx.request(method, fake.url + path, content=encode(body), headers=headers, timeout=30)
    check_error_body(response, status, param)


def test_health_after_bad_inputs(fake):
    for _, method, path, body, _, _ in cases(256, VOCAB):
        httpx.request(method, fake.url + path, content=encode(body), headers=fake.headers, timeout=30)
    assert httpx.get(fake.url + "/health").status_code == 200
    out = _client(fake).completions.create(model="SmolLM2-135M-Instruct", prompt="abc", max_tokens=3)
    assert out.choices[0].text == "def"


def test_max_tokens_must_fit_beside_the_prompt_as_vllm_says(fake):
    """The request's own max_tokens past max_model_len - prompt is a 400 in vLLM's words; one that
    fits exactly runs, and a request without one gets what room is left."""
    client = _client(fake)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "x" * 200}],
                                       max_completion_tokens=150)
    message = err.value.body["message"]
    assert message.startswith("'max_tokens' or 'max_completion_tokens' is too large: 150. This model's maximum "
                              "context length is 256 tokens and your request has ") and err.value.body["param"] == "max_tokens"
    n = int(message.split("your request has ")[1].split()[0])
    assert message.endswith(f"(150 > 256 - {n}).")
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt=[1] * 250, max_tokens=6)
    assert out.usage.completion_tokens == 6
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "x" * 200}])
    assert out.usage.prompt_tokens + out.usage.completion_tokens <= 256


def test_max_logprobs_flag_sets_the_cap_as_vllm_does():
    """--max-logprobs 25: 25 alternatives a token come back, 26 is a 400 naming the flag (completions'
    logprobs, chat's top_logprobs and prompt_logprobs alike)."""
    server = fake_server("--max-model-len", "256", "--max-logprobs", "25", env={"TOKENFORGE_FAKE_STEP_S": "0.002"})
    try:
        client = _client(server)
        out = client.completions.create(model="SmolLM2-135M-Instruct", prompt="abc", max_tokens=2, logprobs=25)
        assert [len(top) for top in out.choices[0].logprobs.top_logprobs] == [25, 25]
        user = [{"role": "user", "content": "hi"}]
        chat = {"messages": user, "logprobs": True, "top_logprobs": 26}
        for call, kw, param in ((client.completions.create, {"prompt": "abc", "logprobs": 26}, "logprobs"),
                                (client.chat.completions.create, chat, "top_logprobs"),
                                (client.completions.create, {"prompt": "abc", "extra_body": {"prompt_logprobs": 26}},
                                 "prompt_logprobs")):
            with pytest.raises(openai.BadRequestError) as err:
                call(model="SmolLM2-135M-Instruct", max_tokens=2, **kw)
            body = err.value.body
            assert body["param"] == param and "[0, 25] (the server's --max-logprobs), got 26" in body["message"], body
    finally:
        server.stop()


def test_top_logprobs_zero_needs_no_logprobs(fake):
    """As vLLM: top_logprobs 0 asks for no alternatives, so logprobs may stay off (no logprobs come back)."""
    out = _client(fake).chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "a"}],
                                                max_tokens=2, top_logprobs=0)
    assert out.choices[0].logprobs is None


def test_protect_all_routes():
    server = fake_server("--protect-all-routes", api_key="sk-all")
    try:
        for path in ("/metrics", "/version", "/tokenizer_info", "/openapi.json"):
            check_error_body(httpx.get(server.url + path), 401, None)
            assert httpx.get(server.url + path, headers=server.headers).status_code == 200, path
        check_error_body(httpx.post(server.url + "/tokenize", json={"prompt": "ab"}), 401, None)
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()


def test_access_log():
    server = fake_server("--enable-access-log")
    try:
        httpx.post(server.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3}).raise_for_status()
        body = {"prompt": "abc", "max_tokens": 2, "stream": True}
        httpx.post(server.url + "/v1/completions", json=body).raise_for_status()
        httpx.get(server.url + "/v1/models/nope")

        def access_lines() -> list[str]:
            return [line for line in server.output().splitlines() if "tokenforge.access" in line and "/health" not in line]
        _until(lambda: len(access_lines()) >= 3)
        lines = access_lines()
    finally:
        server.stop()
    assert re.search(r"POST /v1/completions 200 tokens_in=3 tokens_out=3 ttft=\d+\.\dms total=", lines[0]), lines
    assert re.search(r"POST /v1/completions 200 tokens_in=3 tokens_out=2 ttft=", lines[1]), lines
    assert re.search(r"GET /v1/models/nope 404 tokens_in=0 tokens_out=0 ttft=- total=", lines[2]), lines


def test_auth(fake):
    url = fake.url + "/v1/models"
    none = httpx.get(url)
    check_error_body(none, 401, None)
    assert none.json()["error"]["code"] == "invalid_api_key"
    check_error_body(httpx.get(url, headers={"Authorization": "Bearer sk-wrong"}), 401, None)
    check_error_body(httpx.get(url, headers={"Authorization": "Basic sk-test"}), 401, None)
    assert httpx.get(url, headers=fake.headers).status_code == 200
    assert httpx.get(fake.url + "/health").status_code == 200          # open without a key
    check_error_body(httpx.post(fake.url + "/v1/completions", json={"prompt": "a"}), 401, None)
    # As vLLM: only /v1/* is guarded, so tokenizer alignment (vllm bench serve, lm-eval) works.
    for path in ("/metrics", "/version", "/tokenizer_info", "/openapi.json"):
        assert httpx.get(fake.url + path).status_code == 200, path
    assert httpx.post(fake.url + "/tokenize", json={"prompt": "ab"}).json()["tokens"] == [97, 98]
    assert httpx.post(fake.url + "/detokenize", json={"tokens": [97]}).json()["prompt"] == "a"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=fake.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_completion_shapes(fake):
    client = _client(fake)
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt=["ab", "hijklm"], n=2,
                                    max_tokens=4, logprobs=2, stop=["f"])
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == "cde" and out.choices[0].finish_reason == "stop"
    assert out.choices[2].text == "ghij" and out.choices[2].finish_reason == "length"
    assert out.usage.prompt_tokens == 8 and out.usage.completion_tokens == 4 * 4   # "f" ends choices 0, 1
    lp = out.choices[2].logprobs
    assert lp.tokens == list("ghij") and lp.text_offset == [0, 1, 2, 3]
    assert lp.token_logprobs == [-0.25] * 4 and len(lp.top_logprobs[0]) == 2
    echoed = client.completions.create(model="SmolLM2-135M-Instruct", prompt="xy", max_tokens=2, echo=True)
    assert echoed.choices[0].text == "xycd"


def test_chat_stream_format(fake):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 1}
    with httpx.stream("POST", fake.url + "/v1/chat/completions", json=body, headers=fake.headers) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == "uvw"
        assert [c["finish_reason"] for c in mine][-1] == "length" and mine[-1]["delta"] == {}
        assert all(c["finish_reason"] is None for c in mine[:-1])
        assert mine[1]["logprobs"]["content"][0]["token"] == "u"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(c["usage"] is None for c in chunks[:-1])


def test_tokenize_detokenize_version(fake):
    tok = httpx.post(fake.url + "/tokenize", json={"prompt": "abc"}, headers=fake.headers).json()
    assert tok == {"count": 3, "max_model_len": 256, "tokens": [97, 98, 99]}
    detok = httpx.post(fake.url + "/detokenize", json={"tokens": [97, 98]}, headers=fake.headers).json()
    assert detok == {"prompt": "ab"}
    assert "version" in httpx.get(fake.url + "/version", headers=fake.headers).json()
    chat = httpx.post(fake.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]},
                      headers=fake.headers).json()
    assert chat["count"] == len("<user>hi\n<assistant>")


def test_disconnects_free_everything(fake):
    """Streams dropped mid-way are aborted in the core: nothing stays running afterwards."""
    def stream(drop: bool) -> None:
        body = {"prompt": "go", "max_tokens": 150, "stream": True}
        with httpx.stream("POST", fake.url + "/v1/completions", json=body, headers=fake.headers, timeout=60) as r:
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if drop and i > 4:
                    return

    threads = [threading.Thread(target=stream, args=(i % 3 == 0,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _metric(fake, "tokenforge:num_requests_running") > 0:
        time.sleep(0.1)
    assert _metric(fake, "tokenforge:num_requests_running") == 0
    assert _metric(fake, "tokenforge:kv_cache_usage_perc") == 0


def test_overload_and_sigterm_drain():
    server = fake_server("--max-num-seqs", "1", "--max-queued-requests", "0", env={"TOKENFORGE_FAKE_STEP_S": "0.02"})
    try:
        body = {"prompt": "go", "max_tokens": 60, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            busy = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
            check_error_body(busy, 429, None)
            assert busy.headers["retry-after"] == "1"
            server.proc.send_signal(signal.SIGTERM)
            refused = 200

            def health_refused() -> bool:
                nonlocal refused
                try:
                    refused = httpx.get(server.url + "/health", timeout=2).status_code
                except httpx.HTTPError:
                    refused = "refused"
                return refused != 200
            _until(health_refused)
            assert refused in (503, "refused")
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(30) == 0
    finally:
        server.stop()


def test_drain_timeout_ends_streams_cleanly():
    server = fake_server("--shutdown-timeout", "0.5", env={"TOKENFORGE_FAKE_STEP_S": "0.02"})
    try:
        body = {"prompt": "go", "max_tokens": 200, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            server.proc.send_signal(signal.SIGTERM)
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2][6:])
        assert last["choices"][0]["finish_reason"] == "abort"    # ended explicitly, not cut
        assert all("error" not in json.loads(e[6:]) for e in events[:-1])
        assert 0 < len(events) - 1 < 200
        assert server.proc.wait(30) == 0
    finally:
        server.stop()


def test_timeout_then_engine_crash():
    server = fake_server("--request-timeout", "0.3", env={"TOKENFORGE_FAKE_STEP_S": "0.02"})
    try:
        slow = httpx.post(server.url + "/v1/completions", json={"prompt": "go", "max_tokens": 100})
        check_error_body(slow, 408, None)
        rejected = httpx.post(server.url + "/v1/completions", json={"prompt": "REJECT me", "max_tokens": 2})
        check_error_body(rejected, 400, None)
        assert httpx.get(server.url + "/health").status_code == 200
        crashed = httpx.post(server.url + "/v1/completions", json={"prompt": "CRASH", "max_tokens": 2})
        check_error_body(crashed, 503, None)
        check_error_body(httpx.get(server.url + "/health"), 503, None)
        assert server.proc.wait(15) == 1
    finally:
        server.stop()


def test_killed_engine_process():
    server = fake_server(env={"TOKENFORGE_FAKE_STEP_S": "0.02"})
    try:
        body = {"prompt": "go", "max_tokens": 200, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            server_pid_engine = server.engine_pid()
            killed_at = time.monotonic()
            import os
            os.kill(server_pid_engine, signal.SIGKILL)
            events = [line for line in lines if line.startswith("data: ")]
        assert "error" in json.loads(events[-2][6:])
        status = None
        while time.monotonic() - killed_at < 30:
            try:
                status = httpx.get(server.url + "/health", timeout=1).status_code
            except httpx.HTTPError:
                status = "gone"
            if status != 200:
                break
            time.sleep(0.05)
        assert status in (503, "gone")
        assert server.proc.wait(15) != 0
    finally:
        server.stop()


METRICS = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_cache_fragmentation",
           "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total",
           "generation_tokens_total", "request_success_total", "time_to_first_token_seconds_bucket",
           "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
           "request_queue_time_seconds_bucket"]


def test_metric_names(fake):
    _client(fake).completions.create(model="SmolLM2-135M-Instruct", prompt="abc", max_tokens=3)
    text = httpx.get(fake.url + "/metrics", headers=fake.headers).text
    for name in METRICS:
        assert re.search(rf"^tokenforge:{name}{{", text, re.MULTILINE), name
    assert 'finished_reason="length"' in text


def test_non_streaming_disconnect_aborts(fake):
    before = _metric(fake, "tokenforge:generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fake.url + "/v1/completions", json={"prompt": "go", "max_tokens": 200, "ignore_eos": True},
                   headers=fake.headers, timeout=0.2)
    _until(lambda: _metric(fake, "tokenforge:num_requests_running") == 0)
    assert _metric(fake, "tokenforge:num_requests_running") == 0
    generated = _metric(fake, "tokenforge:generation_tokens_total")
    time.sleep(0.2)
    assert _metric(fake, "tokenforge:generation_tokens_total") == generated
    assert generated - before < 200     # it was cut short, not finished


def test_schemathesis_finds_no_server_errors(fake):
    pytest.importorskip("schemathesis")
    import shutil
    import subprocess

    st = shutil.which("st") or shutil.which("schemathesis")
    if st is None:
        pytest.skip("schemathesis CLI not on PATH")
    result = subprocess.run([st, "run", fake.url + "/openapi.json", "--checks", "not_a_server_error",
                             "--max-examples", "10", "-H", f"Authorization: Bearer {fake.api_key}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]


def test_kept_alive_connection_answers_without_nagle_delay(fake):
    """Responses on a reused connection arrive in about a millisecond. With Nagle on (a listening
    socket of proto 0, which asyncio does not give TCP_NODELAY) each body waited ~40 ms for the
    client's delayed ACK of the headers.

    The reference is the same request on a fresh connection each time (quick either way, and as
    slow as the kept-alive one on a loaded machine), interleaved so both see the same load: the
    Nagle wait is a fixed ~40 ms on top, so the kept-alive median stays under 20 ms or under twice
    the fresh one's, whichever is larger."""
    def timed(client: httpx.Client) -> float:
        start = time.perf_counter()
        assert client.get(fake.url + "/health").status_code == 200
        return time.perf_counter() - start

    kept, fresh = [], []
    with httpx.Client(headers=fake.headers) as client:
        client.get(fake.url + "/health")                     # the first exchange is quick either way
        for _ in range(9):
            kept.append(timed(client))
            with httpx.Client(headers=fake.headers) as once:
                fresh.append(timed(once))
    kept_median, fresh_median = sorted(kept)[4], sorted(fresh)[4]
    assert kept_median < max(0.02, 2 * fresh_median), (kept, fresh)


def test_docs_work_offline(fake):
    """/docs is Swagger UI from the packaged assets: no CDN, so it renders without network."""
    page = httpx.get(fake.url + "/docs", headers=fake.headers)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "/docs/assets/swagger-ui-bundle.js" in page.text and "/openapi.json" in page.text
    assert "cdn." not in page.text and "https://" not in page.text.replace("https://fastapi", "")
    for asset, kind in (("swagger-ui-bundle.js", "javascript"), ("swagger-ui.css", "text/css")):
        got = httpx.get(f"{fake.url}/docs/assets/{asset}", headers=fake.headers)
        assert got.status_code == 200 and kind in got.headers["content-type"] and len(got.content) > 10_000
    assert httpx.get(fake.url + "/redoc", headers=fake.headers).status_code == 404


def test_both_processes_log_in_one_format(fake):
    """The API process and the engine-core process share logs.LOG_FORMAT, told apart by a tag."""
    import re

    line_format = re.compile(r"\d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO |WARNING|ERROR) \[(api|engine-core)\] [\w.]+: ")
    with open(fake.log.name, errors="replace") as f:
        lines = [line for line in f.read().splitlines() if re.match(r"\d\d:\d\d:\d\d", line)]
    assert lines and all(line_format.match(line) for line in lines), lines
    tags = {line_format.match(line).group(2) for line in lines}
    assert tags == {"api", "engine-core"}, lines
    assert any("engine core ready in" in line for line in lines)


def test_stream_interval_sends_the_first_token_then_groups():
    """--stream-interval 4: chunks of >= 4 tokens after the first, the finish in the last; the text
    is the same as with one chunk per token. (A loaded machine may merge the first token with
    later ones, so its length is not asserted here; tests/engine/test_request_stream.py pins the
    exact release points.)"""
    server = fake_server("--stream-interval", "4", env={"TOKENFORGE_FAKE_STEP_S": "0.002"})
    try:
        body = {"prompt": "abc", "max_tokens": 13, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    finally:
        server.stop()
    texts = [e["choices"][0]["text"] for e in events]
    expected = "".join(chr(ord("a") + (3 + k) % 26) for k in range(13))
    assert "".join(texts) == expected
    assert all(len(t) >= 4 for t in texts[1:-1]) and len(texts) <= 5, texts
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
