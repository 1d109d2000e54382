"""`tokenforge router` in front of two real `tokenforge serve --enable-lora` replicas (tiny-llama,
dummy weights, CPU) serving different adapters: a request naming an adapter always lands on a
replica that serves it, and one loaded at run time is found at the next health poll."""

from __future__ import annotations

import sys
import time

import httpx
import pytest

from tokenforge.model.loader import read_arch_config
from tokenforge.model.loader.peft import write_random_adapter

from ..server.servers import ServerProcess

pytestmark = pytest.mark.slow
SERVE = [sys.executable, "-m", "tokenforge.cli", "serve", "--model", "tiny-llama", "--load-format", "dummy",
         "--device", "cpu", "--num-threads", "1", "--enable-lora", "--max-lora-rank", "8", "--num-kv-blocks", "128",
         "--allow-runtime-lora-updating", "--log-level", "warning"]
ROUTER = [sys.executable, "-m", "tokenforge.cli", "router", "--health-interval", "0.3", "--log-level", "warning"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    arch = read_arch_config("tiny-llama", "dummy")
    paths = {n: str(write_random_adapter(arch, root / n, rank=4, seed=i)) for i, n in enumerate(("sql", "chat"))}
    replicas = [ServerProcess([*SERVE, "--lora-modules", f"sql={paths['sql']}"]),
                ServerProcess([*SERVE, "--lora-modules", f"chat={paths['chat']}"])]
    router = None
    try:
        for r in replicas:
            r.wait_healthy(180)
        router = ServerProcess([*ROUTER, "--replica", *(r.url for r in replicas)])
        router.wait_healthy(60)
        yield replicas, router, paths
    finally:
        for proc in [router, *replicas]:
            if proc is not None:
                proc.stop()


def _served_by(router, model: str, prompt: list[int]) -> str:
    r = httpx.post(router.url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2,
                                                          "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers["x-tokenforge-replica"]


def _wait_for(router, url: str, adapter: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = {r["url"]: r.get("adapters", []) for r in httpx.get(router.url + "/router/replicas").json()["replicas"]}
        if adapter in listed.get(url, []):
            return
        time.sleep(0.05)
    raise AssertionError(f"the router never saw {adapter} on {url}")


def test_adapter_requests_land_where_the_adapter_is(fleet):
    (sql, chat), router, paths = fleet
    _wait_for(router, sql.url, "sql")
    _wait_for(router, chat.url, "chat")
    prompts = [[i, i + 1, i + 2, 7, 9] * 8 for i in range(1, 40, 3)]
    assert {_served_by(router, "sql", p) for p in prompts} == {sql.url}
    assert {_served_by(router, "chat", p) for p in prompts} == {chat.url}
    assert len({_served_by(router, "tiny-llama", p) for p in prompts}) == 2      # the base: spread by prefix
    load = httpx.post(chat.url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": paths["sql"]})
    assert load.status_code == 200
    _wait_for(router, chat.url, "sql")
    assert {_served_by(router, "sql", p) for p in prompts} == {sql.url, chat.url}    # now both serve it
