"""Who may open the web UI: --api-key (the page asks for the key, a wrong one is refused),
--protect-all-routes (the pages themselves need the key) and --no-ui (no /ui route at all, on the
server and on the router).

The servers are the real HTTP stack around the fake engine core (tests/server/fake_server.py):
these rules belong to the server, not to the model, and the fake starts in a second or two.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import httpx
import pytest

from tokenforge.router.metrics import RouterMetrics
from tokenforge.router.policy import Policy
from tokenforge.router.proxy import RouterApp
from tokenforge.router.replicas import Replica, ReplicaPool
from tokenforge.router.settings import RouterSettings

from ..server.servers import HERE, ServerProcess
from .browser import chromium, pages, run_async, wait_ready

pytestmark = pytest.mark.timeout(180)        # every wait inside has its own timeout too

KEY = "sk-ui-test"
FAKE_SERVER = os.path.join(HERE, "fake_server.py")
UI_PATHS = ("/ui", "/ui/", "/ui/dashboard", "/ui/assets/core.js", "/ui/api/stats")


@pytest.fixture(scope="module")
def servers():
    started: list[ServerProcess] = []
    try:                    # all three start at once, then each is waited for
        for flags, key in ((("--max-model-len", "256"), KEY), (("--protect-all-routes",), KEY), (("--no-ui",), None)):
            started.append(ServerProcess([sys.executable, FAKE_SERVER, *flags], api_key=key))
        for server in started:
            server.wait_healthy(300)
        yield dict(zip(("keyed", "protected", "no_ui"), started))
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


def test_no_ui_leaves_no_ui_route(servers):
    server = servers["no_ui"]
    for path in UI_PATHS:
        response = httpx.get(server.url + path)
        assert response.status_code == 404, path
    assert httpx.get(server.url + "/health").status_code == 200
    assert all(not p.startswith("/ui") for p in httpx.get(server.url + "/openapi.json").json()["paths"])


def test_protect_all_routes_guards_the_pages_too(servers):
    server = servers["protected"]
    for path in UI_PATHS:
        refused = httpx.get(server.url + path)
        assert refused.status_code == 401, path
        assert refused.json()["error"]["type"] == "authentication_error"
        assert httpx.get(server.url + path, headers=server.headers).status_code == 200, path


def test_with_an_api_key_the_page_asks_for_it_and_refuses_a_wrong_one(servers, browser):
    server = servers["keyed"]
    wrong = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer sk-wrong"})
    assert wrong.status_code == 401
    assert httpx.get(server.url + "/ui").status_code == 200          # the page holds no data; /v1 needs the key
    with pages(browser) as open_page:
        _asks_for_the_key(open_page(server.url + "/ui"), server, wrong.json()["error"]["message"])


def _asks_for_the_key(page, server, refusal: str) -> None:
    page.wait_for_selector("#key-dialog[open]")
    assert page.inner_text("#key-error") == ""
    page.fill("#key-input", "sk-wrong")
    page.press("#key-input", "Enter")
    page.wait_for_selector("#key-error:not(:empty)")
    assert page.inner_text("#key-error") == "The key was refused: " + refusal
    assert page.get_attribute("body", "data-ready") is None          # nothing was shown with the wrong key
    page.fill("#key-input", KEY)
    page.press("#key-input", "Enter")
    wait_ready(page)
    assert page.inner_text("#model-name") == httpx.get(server.url + "/v1/models", headers=server.headers).json()["data"][0]["id"]
    assert page.evaluate("() => JSON.parse(localStorage.getItem('tokenforge.apiKey'))") == KEY
    assert [p for p in page.problems if "status of 401" not in p] == []


def _router_get(ui: bool, path: str) -> tuple[int, bytes, list[str]]:
    """GET `path` from an in-process router (round-robin, one scripted replica): status, body, and
    the requests that reached the replica."""
    reached: list[str] = []

    async def replica(request: httpx.Request) -> httpx.Response:
        reached.append(request.url.path)
        return httpx.Response(200, json={"from": "replica"})

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(replica)) as client:
            settings = RouterSettings(replicas=("http://replica:1",), policy="round-robin", ui=ui)
            metrics = RouterMetrics()
            pool = ReplicaPool(settings, None, client, on_change=metrics.on_change)
            pool.replicas["http://replica:1"] = Replica("http://replica:1", state="admitted", healthy=True)
            app = RouterApp(settings, pool, Policy("round-robin", 16), None, client, metrics)
            sent, incoming = [], [{"type": "http.request", "body": b"", "more_body": False}]

            async def receive():
                if incoming:
                    return incoming.pop()
                await asyncio.sleep(3600)          # the client stays connected

            async def send(message):
                sent.append(message)
            await app({"type": "http", "method": "GET", "path": path, "query_string": b"", "headers": []}, receive, send)
            return sent

    sent = run_async(run())        # the module's browser may be open
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), reached


def test_router_no_ui_leaves_no_ui_route_and_sends_none_to_a_replica():
    for path in UI_PATHS:
        status, body, reached = _router_get(False, path)
        assert (status, json.loads(body)["error"]["message"], reached) == (404, "The web UI is off (--no-ui).", []), path
        status, _, reached = _router_get(True, path)
        assert (status, reached) == (200, []), path          # the router's own page, never a replica's
    assert _router_get(False, "/v1/models")[::2] == (200, ["/v1/models"])
