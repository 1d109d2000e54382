"""The web UI in a real headless Chromium against `tokenforge serve` on the bundled SmolLM2 (CPU).

One server and one browser for the module. Every test opens its own page (a fresh context, so
fresh localStorage) and ends with no console errors unless it provokes one on purpose. What the
page shows is compared with the bytes the server streamed to it (and once with the API's
non-streamed answer). Runs by default (CI installs Chromium); skips without Playwright or Chromium.
With TOKENFORGE_UI_SCREENSHOTS=1 the playground and dashboard screenshots go to docs/images/.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time

import httpx
import pytest

from ..server.servers import ServerProcess
from .browser import chromium, pages, screenshot, wait_ready

# About a minute on an idle 2-core machine: one server and one browser for the module, short answers.
# Every wait has a timeout (browser.WAIT_MS), and each test has its own limit, so none can hang.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# One torch thread: the browser needs the other core, and two threads beside Chromium spin-waited
# for each other (a 20-token answer: 12 CPU-s and 31 s with two threads, 1.8 CPU-s and 4.5 s with
# one, on the loaded 2-core host).
SERVE = [sys.executable, "-m", "tokenforge.cli", "serve", "--device", "cpu", "--num-threads", "1", "--max-num-seqs", "8",
         "--num-kv-blocks", "256", "--max-tokens-limit", "200", "--log-level", "warning"]
MODEL = "SmolLM2-135M-Instruct"
XSS = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
HTTP = httpx.Timeout(300, connect=10)     # a loaded machine answers slowly; never the 5 s default


@pytest.fixture(scope="module")
def live():
    server = ServerProcess(SERVE)
    try:
        server.wait_healthy(300)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


@pytest.fixture
def open_page(browser):
    with pages(browser) as open_:
        yield open_


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=HTTP).text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def playground(open_page, live, **context):
    page = open_page(live.url + "/ui", **context)
    wait_ready(page)
    return page


def set_controls(page, **values) -> None:
    for key, value in values.items():
        selector = f"#p-{key}"
        if key == "tool_choice":
            page.select_option(selector, value)
        else:
            page.fill(selector, str(value))


def send(page, text: str) -> None:
    page.focus("#prompt")
    page.keyboard.type(text)
    page.keyboard.press("Enter")        # the keyboard alone sends


def last_answer(page):
    page.wait_for_selector("body:not([data-streaming='1'])", state="attached")
    page.wait_for_selector("#chat .msg.assistant:not(.streaming) .speed")
    return page.locator("#chat .msg.assistant").last


def exchange(page, act, path: str = "/v1/chat/completions"):
    """Do act() (a send, a click) and wait for the answer: (its element, the body the page sent,
    the stream the server sent back, summed up by `streamed`), so a test checks the page against
    the server's own bytes without generating the answer twice."""
    with page.expect_response(lambda r: r.url.endswith(path) and r.request.method == "POST") as info:
        act()
    response = info.value
    body = response.body().decode()          # the whole stream, once it has ended
    assert response.status == 200, body
    return last_answer(page), response.request.post_data_json, streamed(body)


def streamed(body: str) -> dict:
    """An SSE body of /v1/chat/completions or /v1/completions, summed up: text, tool calls,
    finish reason, usage."""
    out = {"content": "", "tool_calls": {}, "finish_reason": None, "usage": None}
    events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    for event in map(json.loads, events[:-1]):
        out["usage"] = event.get("usage") or out["usage"]
        for choice in event["choices"]:
            delta = choice.get("delta", {})
            out["content"] += choice.get("text") or delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                slot = out["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                slot["name"] += call.get("function", {}).get("name") or ""
                slot["arguments"] += call.get("function", {}).get("arguments") or ""
            out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
    out["tool_calls"] = [out["tool_calls"][k] for k in sorted(out["tool_calls"])]
    return out


def stored(page) -> dict:
    """The current conversation as the page keeps it in localStorage."""
    return page.evaluate("""() => { const id = JSON.parse(localStorage.getItem('tokenforge.current'));
        return JSON.parse(localStorage.getItem('tokenforge.conversations')).find(c => c.id === id); }""")


def api_chat(live, text: str, **params) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], **params}
    response = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=HTTP)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_page_loads_fast_and_small_without_console_errors(open_page, live):
    """First load over the wire (every response's headers and encoded body, as the browser got
    them: gzip) <= 200 KB. The time to interactive is printed, not asserted (load moves it)."""
    responses = []
    page = open_page("")
    page.on("requestfinished", lambda request: responses.append(request))
    page.goto(live.url + "/ui")
    ready_ms = wait_ready(page)
    page.wait_for_load_state("networkidle")
    assert page.inner_text("#model-name") == MODEL
    assert page.get_attribute("#nav-playground", "aria-current") == "page"
    wire = {r.url.removeprefix(live.url): r.sizes()["responseBodySize"] + r.sizes()["responseHeadersSize"]
            for r in responses}
    assert {"/ui", "/ui/assets/core.js", "/ui/assets/app.css", "/v1/models"} <= set(wire), wire
    assert 0 < sum(wire.values()) <= 200 * 1024, wire
    print(f"\nplayground interactive after {ready_ms:.0f} ms; first load {sum(wire.values())} bytes over the wire "
          f"in {len(wire)} responses")
    assert page.problems == []


def test_a_chat_message_streams_in_with_its_speed_line(open_page, live, tmp_path):
    question = "Write a Python function that adds two numbers."
    page = playground(open_page, live)
    set_controls(page, temperature=0, max_tokens=20)

    # What the chat looked like at every change, recorded in the page: no race with a fast stream.
    page.evaluate("""() => { window.__partial = [];
        new MutationObserver(() => { const m = document.querySelector('#chat .msg.assistant.streaming .content');
            if (m) window.__partial.push([m.textContent.length, !document.querySelector('#stop').disabled,
                                          document.querySelector('#send').disabled]); })
          .observe(document.querySelector('#chat'), {childList: true, subtree: true, characterData: true}); }""")

    def act():
        send(page, question)
    answer, sent, got = exchange(page, act)
    assert sent["messages"] == [{"role": "user", "content": question}]
    assert (sent["temperature"], sent["max_tokens"], sent["stream"]) == (0, 20, True)
    speed = answer.locator(".speed").inner_text()
    usage = got["usage"]
    assert re.fullmatch(rf"{usage['prompt_tokens']} in · {usage['completion_tokens']} out · TTFT \d+ ms · "
                        rf"[\d.]+ tok/s · finish: {got['finish_reason']}", speed), speed
    content = got["content"]
    partial = page.evaluate("() => window.__partial")
    assert len({n for n, stop_on, send_off in partial if stop_on and send_off and n}) >= 2, partial  # piece by piece
    assert stored(page)["messages"][1]["content"] == content      # the streamed text, exactly
    # ... and the same answer as the API gives without a stream
    assert api_chat(live, question, temperature=0, max_tokens=20)["choices"][0]["message"]["content"] == content
    assert answer.locator(".codeblock").count() == (content.count("```") + 1) // 2   # an open fence is a block
    if "```python" in content:
        assert answer.locator(".codeblock .tok-k").first.inner_text() in ("def", "return", "import")
    screenshot(page, "ui-playground.png", tmp_path)
    assert page.problems == []


def test_stop_cuts_the_stream_and_the_server_frees_its_kv(open_page, live):
    page = playground(open_page, live)
    set_controls(page, temperature=0.8, seed=1, max_tokens=200, extra=json.dumps({"ignore_eos": True}))
    generated = metric(live, "tokenforge:generation_tokens_total")
    send(page, "Tell me a very long story about a dragon and a knight.")
    page.wait_for_function("() => (document.querySelector('#chat .msg.assistant.streaming .content') || {})"
                           ".textContent?.length > 5")
    assert metric(live, "tokenforge:num_requests_running") == 1
    assert metric(live, "tokenforge:kv_cache_usage_perc") > 0
    page.click("#stop")
    speed = last_answer(page).locator(".speed").inner_text()
    assert "finish: stopped" in speed and "≈" in speed
    deadline = time.monotonic() + 120
    while metric(live, "tokenforge:kv_cache_usage_perc") > 0 or metric(live, "tokenforge:num_requests_running"):
        assert time.monotonic() < deadline, "the stopped request still holds KV blocks"
        time.sleep(0.2)
    after = metric(live, "tokenforge:generation_tokens_total")
    time.sleep(1.0)
    assert metric(live, "tokenforge:generation_tokens_total") == after < generated + 200
    assert page.locator("#send").is_enabled() and not page.locator("#stop").is_enabled()
    assert page.problems == []


def test_a_json_schema_request_yields_valid_json_in_the_page(open_page, live):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    page = playground(open_page, live)
    set_controls(page, temperature=0, max_tokens=120, schema=json.dumps(schema))
    send(page, "Name a large city and its population.")
    answer = last_answer(page)
    assert answer.locator(".badge").first.inner_text().lower() == "valid json"
    value = json.loads(answer.locator(".json-output").inner_text())
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    assert page.problems == []


def test_a_tool_call_renders_as_a_tool_call(open_page, live):
    """SmolLM2 does not call tools on its own, so the call is forced: tool_choice "required" and
    parallel_tool_calls false make the server constrain the output to one call of the schema's
    shape, and it answers with real `tool_calls` (finish_reason tool_calls), the same as the API."""
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False}}}]
    extra = {"parallel_tool_calls": False}
    page = playground(open_page, live)
    set_controls(page, temperature=0, max_tokens=40, tools=json.dumps(tools), tool_choice="required",
                 extra=json.dumps(extra))
    answer, sent, got = exchange(page, lambda: send(page, "What is the weather in Paris?"))
    assert (sent["tools"], sent["tool_choice"], sent["parallel_tool_calls"]) == (tools, "required", False)
    assert got["finish_reason"] == "tool_calls" and len(got["tool_calls"]) == 1 and not got["content"]
    function = got["tool_calls"][0]
    assert function["name"] == "get_weather" and set(json.loads(function["arguments"])) == {"city"}
    call = answer.locator(".tool-call")
    assert call.count() == 1 and call.get_attribute("data-name") == "get_weather"
    assert call.locator(".tool-name").inner_text() == "get_weather"
    assert call.locator(".badge").inner_text().lower() == "tool call"
    assert json.loads(call.locator(".tool-args").inner_text()) == json.loads(function["arguments"])
    assert re.search(r" · [\d.]+ tok/s · finish: tool_calls$", answer.locator(".speed").inner_text())
    kept = stored(page)["messages"][1]
    assert [c["function"]["name"] for c in kept["tool_calls"]] == ["get_weather"] and not kept["content"]
    assert page.problems == []


def test_a_bad_value_shows_the_servers_400_message(open_page, live):
    expected = httpx.post(live.url + "/v1/chat/completions", timeout=HTTP, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1, "max_tokens": 4,
        "stream": True, "stream_options": {"include_usage": True}})
    assert expected.status_code == 400
    page = playground(open_page, live)
    set_controls(page, temperature=-1, max_tokens=4)
    send(page, "hi")
    page.wait_for_selector("#error:not(:empty)")
    assert page.inner_text("#error") == "Error 400: " + expected.json()["error"]["message"]
    assert page.locator("#chat .msg.assistant").count() == 0 and page.locator("#send").is_enabled()
    assert [p for p in page.problems if "status of 400" not in p] == []


def test_model_output_with_script_and_onerror_is_shown_never_run(open_page, live):
    """The live model is made to say XSS exactly: a one-item `structured_outputs.choice` constrains
    every token, so the text comes out of the real engine and streams through the page's real
    rendering path (markdown.js into the chat), as any answer would. It shows as text; nothing runs."""
    page = playground(open_page, live)
    page.evaluate("() => { window.__pwned = undefined; }")
    extra = {"structured_outputs": {"choice": [XSS]}}
    set_controls(page, temperature=0, max_tokens=100, extra=json.dumps(extra))
    answer, _, got = exchange(page, lambda: send(page, "Say something."))
    assert got["content"] == XSS and got["finish_reason"] == "stop"        # what the engine sent
    assert stored(page)["messages"][1]["content"] == XSS
    assert answer.locator(".content").inner_text().strip() == XSS
    page.wait_for_timeout(300)          # an <img onerror> would have fired by now
    assert page.evaluate("() => window.__pwned") is None
    assert page.locator("#chat script, #chat img, #chat [onerror]").count() == 0
    # The renderer itself, on markdown around the same text: nested emphasis (which once looped
    # forever), a javascript: link (kept as text), a fenced block holding a script tag.
    source = "# t\n" + XSS + "\n[x](javascript:alert(1)) **b *i* b** `c`\n```html\n<script>x</script>\n```"
    rendered = page.evaluate("""(source) => { const d = document.createElement('div');
        d.append(TF.md.render(source));
        return {html: d.innerHTML, text: d.textContent, links: [...d.querySelectorAll('a')].length,
                tags: [...d.querySelectorAll('*')].map(e => e.tagName.toLowerCase())}; }""", source)
    assert rendered["links"] == 0 and "script" not in rendered["tags"] and "img" not in rendered["tags"]
    assert "&lt;script&gt;" in rendered["html"] and {"h3", "strong", "em", "code", "pre"} <= set(rendered["tags"])
    assert XSS in rendered["text"] and "x (javascript:alert(1))" in rendered["text"]
    assert page.evaluate("() => window.__pwned") is None
    assert page.problems == []


def test_completions_mode_regenerate_and_edit_and_resend(open_page, live):
    page = playground(open_page, live)
    page.click("#new-completion")
    set_controls(page, temperature=0, max_tokens=8)
    answer, sent, got = exchange(page, lambda: send(page, "The capital of France is"), "/v1/completions")
    assert (sent["prompt"], sent["temperature"], sent["max_tokens"]) == ("The capital of France is", 0, 8)
    assert got["content"] and got["usage"]["completion_tokens"] <= 8
    kept = stored(page)["messages"][1]
    assert kept == {"role": "completion", "content": got["content"], "json": False, "reasoning": "", "stats": kept["stats"]}
    assert answer.locator(".content").text_content() == got["content"]
    page.click("#new-chat")
    set_controls(page, temperature=0, max_tokens=8)
    _, _, first = exchange(page, lambda: send(page, "Hi"))
    _, sent, again = exchange(page, lambda: page.click("#regenerate"))
    assert sent["messages"] == [{"role": "user", "content": "Hi"}] and again["content"] == first["content"]
    assert page.locator("#chat .msg").count() == 2
    page.click("#chat .msg.user .edit")
    page.fill("#chat .edit-box", "Name a color.")
    answer, sent, got = exchange(page, lambda: page.click("#chat .resend"))
    assert sent["messages"] == [{"role": "user", "content": "Name a color."}]
    assert [m.inner_text() for m in page.locator("#chat .msg.user .content").all()] == ["Name a color."]
    assert stored(page)["messages"][1]["content"] == got["content"]
    assert [m["role"] for m in stored(page)["messages"]] == ["user", "assistant"]
    assert page.locator(".conv-list .conv").count() == 3       # the first empty chat, the completion, this chat
    assert page.problems == []


def test_conversations_survive_a_reload_and_round_trip_through_export_and_import(open_page, live, tmp_path):
    page = playground(open_page, live)
    set_controls(page, temperature=0, max_tokens=4)
    send(page, "Hello there")
    last_answer(page)
    page.reload()
    wait_ready(page)
    assert page.locator("#chat .msg.user .content").inner_text() == "Hello there"
    with page.expect_download() as download:
        page.click("#export")
    exported = tmp_path / "conversations.json"
    download.value.save_as(exported)
    data = json.loads(exported.read_text())
    assert data["format"] == "tokenforge.conversations" and data["conversations"][0]["messages"][0]["content"] == "Hello there"
    page.set_input_files("#import-file", str(exported))
    page.wait_for_function("() => document.querySelectorAll('.conv-list .conv').length === 2")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    page.set_input_files("#import-file", str(bad))
    page.wait_for_selector("#error:not(:empty)")
    assert page.inner_text("#error").startswith("Import failed: not JSON")
    assert page.problems == []


def test_phone_width_and_dark_theme(open_page, live):
    page = playground(open_page, live, viewport={"width": 390, "height": 844}, color_scheme="dark")
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 390
    dark = page.evaluate("() => getComputedStyle(document.body).backgroundColor")
    page.click("#theme-button")
    light = page.evaluate("() => getComputedStyle(document.body).backgroundColor")
    assert dark == "rgb(21, 22, 26)" and light == "rgb(247, 247, 248)"
    page.goto(live.url + "/ui/dashboard")
    wait_ready(page)
    page.wait_for_selector(".chart[data-draws]")
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 390
    assert page.problems == []


def _load(url: str, stop: threading.Event) -> None:
    with httpx.Client(timeout=HTTP) as client:
        while not stop.is_set():
            client.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24,
                                                       "temperature": 0.8})


def test_the_dashboard_charts_update_while_a_load_runs(open_page, live, tmp_path):
    page = open_page(live.url + "/ui/dashboard")
    wait_ready(page)
    tokens = page.locator('.chart[data-chart="Tokens/s"]')
    tokens.wait_for()
    assert page.inner_text("#dash-model") == MODEL
    assert page.locator("#phases li").count() >= 4            # the engine core's start-up phases
    draws = int(tokens.get_attribute("data-draws"))
    stop = threading.Event()
    workers = [threading.Thread(target=_load, args=(live.url, stop)) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        page.wait_for_function("""() => { const legend = document.querySelector('.chart[data-chart="Tokens/s"] .legend');
            const out = legend && legend.children[1].querySelector('b').textContent;
            return out && parseFloat(out) > 0; }""", timeout=300_000)
        page.wait_for_function("() => document.querySelector('#card-running').textContent !== '0'", timeout=300_000)
        page.wait_for_function("() => parseFloat(document.querySelector('.chart[data-chart=\"TTFT over the last minute\"]"
                               " .legend b').textContent) > 0", timeout=300_000)
        screenshot(page, "ui-dashboard.png", tmp_path)
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert int(tokens.get_attribute("data-draws")) > draws
    assert tokens.locator("path[data-series='out (generated)']").get_attribute("d").count("L") >= 1
    assert "stop" in page.inner_text("#finished") or "length" in page.inner_text("#finished")
    assert page.problems == []
