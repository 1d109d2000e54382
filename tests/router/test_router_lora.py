"""The router and LoRA adapters: residency is learned from each replica's /v1/models (entries with
a parent), and a request naming an adapter goes to the replicas that serve it, spread among them
by the prompt's key; base-model requests are placed as before."""

from __future__ import annotations

import asyncio

import httpx

from tokenforge.router.discovery import StaticReplicas
from tokenforge.router.policy import Policy
from tokenforge.router.replicas import Replica, ReplicaPool, adapters_of
from tokenforge.router.settings import RouterSettings


def _replicas(n: int) -> list[Replica]:
    return [Replica(f"http://10.0.0.{i}:8000", state="admitted") for i in range(n)]


def test_adapter_requests_prefer_replicas_that_serve_the_adapter():
    policy = Policy("prefix", overload_waiting=16)
    replicas = _replicas(4)
    replicas[1].adapters = frozenset({"sql", "chat"})
    replicas[3].adapters = frozenset({"sql"})
    keys = [bytes([i]) * 32 for i in range(60)]
    firsts = {policy.order(replicas, k, "sql")[0][0].url for k in keys}
    assert firsts == {replicas[1].url, replicas[3].url}                   # only the two that serve it, both used
    for k in keys:
        order, reason = policy.order(replicas, k, "chat")
        assert order[0] is replicas[1] and sorted(r.url for r in order) == sorted(r.url for r in replicas)
        assert reason in ("prefix", "lora_resident")
        assert policy.order(replicas, k, "base") == policy.order(replicas, k)     # not an adapter: unchanged
        assert policy.order(replicas, k, "nowhere") == policy.order(replicas, k)
    assert policy.order(replicas, None, "sql")[0][0] in (replicas[1], replicas[3])   # no key: least loaded of them
    replicas[1].waiting = 99                                              # overloaded, still the only one with it
    assert policy.order(replicas, keys[0], "chat")[0][0] is replicas[1]
    assert Policy("round-robin", 4).order(replicas, keys[0], "chat")[0][0] is replicas[1]


def test_residency_is_learned_from_v1_models():
    assert adapters_of({"data": [{"id": "m", "parent": None}, {"id": "a", "parent": "m"}, {"id": "b", "parent": "m"},
                                 "junk", {"parent": "m"}]}) == {"a", "b"}
    assert adapters_of({"status": "ok"}) == frozenset() and adapters_of([]) == frozenset()
    models = {"data": [{"id": "m", "parent": None}, {"id": "sql", "parent": "m"}]}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text='tokenforge:model_info{checksum="c",model_name="m",version=""} 1.0\n')
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=models) if "r1" in str(request.url) else httpx.Response(404, json={})
        return httpx.Response(200, json={"status": "ok"})

    async def run():
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        urls = ("http://r1:1", "http://r2:1")
        pool = ReplicaPool(RouterSettings(replicas=urls), StaticReplicas(urls), client)
        await pool.refresh()
        first = {u: r.adapters for u, r in pool.replicas.items()}
        models["data"] = models["data"][:1]                               # unloaded at run time
        await pool.refresh()
        return first, pool.replicas["http://r1:1"].adapters, [r.state for r in pool.replicas.values()]

    first, after_unload, states = asyncio.run(run())
    assert first == {"http://r1:1": {"sql"}, "http://r2:1": frozenset()}
    assert after_unload == frozenset() and states == ["admitted", "admitted"]
