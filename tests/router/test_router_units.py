"""Router pieces without servers: placement policy, discovery, metrics parsing, prefix keys."""

from __future__ import annotations

import argparse
import asyncio
from types import SimpleNamespace

import pytest

from tokenforge.core.hashing import compute_block_hashes
from tokenforge.engine.prefix_hasher import PromptPrefixHasher
from tokenforge.router.discovery import KubernetesEndpoints, StaticReplicas, urls_of
from tokenforge.router.policy import Policy
from tokenforge.router.replicas import Replica, ReplicaPool, parse_metrics
from tokenforge.router.settings import RouterSettings


def _replicas(n: int) -> list[Replica]:
    return [Replica(f"http://10.0.0.{i}:8000", state="admitted") for i in range(n)]


def test_rendezvous_keeps_keys_in_place_when_a_replica_leaves():
    policy = Policy("prefix", overload_waiting=16)
    replicas = _replicas(4)
    keys = [bytes([i]) * 32 for i in range(200)]
    before = {k: policy.order(replicas, k)[0][0].url for k in keys}
    assert len(set(before.values())) == 4                       # spread over all of them
    gone = replicas[2]
    after = {k: policy.order([r for r in replicas if r is not gone], k)[0][0].url for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == gone.url for k in moved)   # only the leaver's keys moved


def test_load_overrides_an_overloaded_choice_and_decides_without_a_key():
    policy = Policy("prefix", overload_waiting=4)
    replicas = _replicas(3)
    key = b"k" * 32
    first = policy.order(replicas, key)[0][0]
    first.waiting = 4
    order, reason = policy.order(replicas, key)
    assert order[0] is not first and order[-1] is first and reason == "overload_override"
    for r in replicas:
        r.waiting = 9
    replicas[1].waiting, replicas[1].in_flight = 5, 3
    assert policy.order(replicas, key) == ([replicas[1], *sorted([replicas[0], replicas[2]], key=lambda r: r.url)],
                                           "all_overloaded")
    replicas[0].waiting = replicas[2].waiting = 5
    replicas[0].in_flight, replicas[2].in_flight = 1, 2
    assert policy.order(replicas, None)[0][0] is replicas[0]           # in-flight breaks the tie
    round_robin = Policy("round-robin", 4)
    assert {round_robin.order(replicas, key)[0][0].url for _ in range(3)} == {r.url for r in replicas}


def test_kubernetes_endpoints_list_ready_addresses_of_the_named_port():
    port = SimpleNamespace
    endpoints = SimpleNamespace(subsets=[
        SimpleNamespace(addresses=[SimpleNamespace(ip="10.1.0.7"), SimpleNamespace(ip="10.1.0.8")],
                        ports=[port(name="metrics", port=9090), port(name="http", port=8000)]),
        SimpleNamespace(addresses=None, ports=[port(name="http", port=8000)]),     # nothing ready
    ])

    class FakeCoreV1:
        def read_namespaced_endpoints(self, name, namespace):
            assert (name, namespace) == ("tokenforge", "llm")
            return endpoints

    found = asyncio.run(KubernetesEndpoints("tokenforge", "llm", "http", api=FakeCoreV1()).discover())
    assert found == ["http://10.1.0.7:8000", "http://10.1.0.8:8000"]
    assert urls_of(endpoints, None) == ["http://10.1.0.7:9090", "http://10.1.0.8:9090"]
    assert asyncio.run(StaticReplicas(("http://a:1/",)).discover()) == ["http://a:1"]


def test_parse_metrics_reads_queue_depth_and_the_model_info():
    text = ('tokenforge:num_requests_waiting{model_name="m"} 3.0\n'
            'tokenforge:num_requests_running{model_name="m"} 7.0\n'
            'tokenforge:kv_cache_usage_perc{model_name="m"} 0.25\n'
            'tokenforge:model_info{checksum="abc",model_name="m",version="v2"} 1.0\n')
    assert parse_metrics(text) == {"waiting": 3.0, "running": 7.0, "kv_usage": 0.25, "model_name": "m",
                                   "version": "v2", "checksum": "abc"}


def test_the_version_rule_refuses_the_odd_one_unless_mixing_is_allowed():
    def pool(**kw) -> ReplicaPool:
        p = ReplicaPool(RouterSettings(replicas=("http://x",), **kw), None, None)
        for i, version in enumerate(["v1", "v2", "v1"]):
            p.replicas[f"http://r{i}"] = Replica(f"http://r{i}", healthy=True, model_name="m", version=version)
        p._apply_version_rule()
        return p

    assert [r.state for r in pool().replicas.values()] == ["admitted", "version_mismatch", "admitted"]
    assert [r.state for r in pool(model_version="v2").replicas.values()] == ["version_mismatch", "admitted",
                                                                             "version_mismatch"]
    assert all(r.admitted for r in pool(allow_mixed_versions=True).replicas.values())


class _Tok:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)


def test_prefix_keys_use_the_engine_block_hashes():
    hasher = PromptPrefixHasher(_Tok(), block_size=4, max_blocks=2)
    shared = "abcdefgh"
    key = hasher.prefix_key({"prompt": shared + "tail one"})
    assert key == compute_block_hashes([ord(c) for c in shared], 4)[-1]
    assert key == hasher.prefix_key({"prompt": shared + "another tail"})
    assert key == hasher.prefix_key({"prompt": [ord(c) for c in shared] + [1, 2, 3]})
    assert key != hasher.prefix_key({"prompt": shared, "cache_salt": "tenant"})
    assert hasher.prefix_key({"prompt": "abc"}) is None                 # no full block
    chat = hasher.prefix_key({"messages": [{"role": "system", "content": "be brief"}]})
    assert chat == compute_block_hashes([ord(c) for c in "<system>be brief"][:8], 4)[-1]
    assert hasher.prefix_key({"messages": "not a list"}) is None


def test_settings_need_exactly_one_source_of_replicas():
    with pytest.raises(ValueError, match="exactly one"):
        RouterSettings().validate()
    with pytest.raises(ValueError, match="exactly one"):
        RouterSettings(replicas=("http://a",), k8s_service="svc").validate()
    with pytest.raises(ValueError, match="http"):
        RouterSettings(replicas=("a:8000",)).validate()


def test_a_replica_is_ejected_after_failed_polls_and_readmitted_when_healthy():
    import httpx

    up = {"ok": True}

    def handler(request: httpx.Request) -> httpx.Response:
        if not up["ok"]:
            raise httpx.ConnectError("down")
        if request.url.path == "/metrics":
            return httpx.Response(200, text='tokenforge:num_requests_waiting{model_name="m"} 2.0\n'
                                             'tokenforge:model_info{checksum="c",model_name="m",version="v1"} 1.0\n')
        return httpx.Response(200, json={"status": "ok"})

    async def run() -> list[str]:
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        pool = ReplicaPool(RouterSettings(replicas=("http://r:1",), eject_after=2), StaticReplicas(("http://r:1",)),
                           client)
        states = []
        for ok in (True, False, False, True):
            up["ok"] = ok
            await pool.refresh()
            states.append(pool.replicas["http://r:1"].state)
        return states, pool.replicas["http://r:1"]

    states, replica = asyncio.run(run())
    assert states == ["admitted", "admitted", "ejected", "admitted"]
    assert (replica.waiting, replica.version, replica.failures) == (2.0, "v1", 0)


def test_the_router_hashes_prefixes_with_the_replicas_tokenizer(tmp_path):
    """--tokenizer: replicas that run another tokenizer route by its ids (the router's prefix keys
    must be the replicas' block hashes); the router takes the same flag."""
    import shutil

    from tokenforge.cli.router import add_router_parser
    from tokenforge.engine.tokenization import load_tokenizer
    from tokenforge.router.app import _hasher

    shutil.copytree(load_tokenizer(None).hf.directory, tmp_path / "tok", dirs_exist_ok=True)
    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers())
    args = parser.parse_args(["router", "--replica", "http://r:1", "--tokenizer", str(tmp_path / "tok")])
    settings = RouterSettings.from_args(args)
    assert settings.tokenizer == str(tmp_path / "tok")
    hasher = _hasher(settings)
    assert hasher.tokenizer.source == str(tmp_path / "tok")
    ids = hasher.tokenizer.encode("The quick brown fox jumps over the lazy dog, twice over, and then once more.")
    assert hasher.prefix_key({"prompt": ids}) == compute_block_hashes(ids[:64], 16)[-1]
