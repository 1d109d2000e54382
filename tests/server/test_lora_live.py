"""`tokenforge serve --enable-lora` with the real engine (tiny-llama, dummy weights, CPU), through the
official openai client: the `model` field picks the adapter (tokens equal the offline LLM's),
/v1/models lists adapters with their parent, adapters load, serve, unload and reload at run time
under concurrent requests without leaking KV blocks, and every bad input is one clear error
(404 unknown adapter, 400 bad adapter, 403 without --allow-runtime-lora-updating)."""

from __future__ import annotations

import asyncio
import json
import re
import sys

import httpx
import openai
import pytest

from tokenforge.model.loader import read_arch_config
from tokenforge.model.loader.peft import write_random_adapter

from .servers import ServerProcess

pytestmark = pytest.mark.slow
BASE = "tiny-llama"
ENGINE = ["--load-format", "dummy", "--device", "cpu", "--enable-lora", "--max-lora-rank", "8", "--block-size", "4",
          "--num-kv-blocks", "256", "--max-num-seqs", "8"]
SERVE = [sys.executable, "-m", "tokenforge.cli", "serve", "--model", BASE, *ENGINE]
PROMPTS = [[5, 17, 99, 3, 42, 8, 250, 31, 77, 12, 64, 9], [300, 301, 302, 7, 8, 9, 10], [88] * 9]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    arch = read_arch_config(BASE, "dummy")
    dirs = {f"a{i}": str(write_random_adapter(arch, root / f"a{i}", rank=8, seed=i, std=0.3)) for i in range(3)}
    dirs["big"] = str(write_random_adapter(arch, root / "big", rank=16))
    return dirs


@pytest.fixture(scope="module")
def expected(adapter_dirs):
    """Offline greedy texts per (adapter or None, prompt index)."""
    from tokenforge import LLM, LoRARequest, SamplingParams

    llm = LLM(BASE, load_format="dummy", enable_lora=True, max_lora_rank=8, max_loras=3, num_kv_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    out = {}
    for i, name in enumerate([None, "a0", "a1"]):
        lora = LoRARequest(name, i, adapter_dirs[name]) if name else None
        for j, text in enumerate(o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False,
                                                                          lora_request=lora)):
            out[name, j] = text
    llm.shutdown()
    assert len({out[n, 0] for n in (None, "a0", "a1")}) == 3       # the adapters visibly change the output
    return out


@pytest.fixture(scope="module")
def live(adapter_dirs):
    server = ServerProcess([*SERVE, "--max-loras", "2", "--max-cpu-loras", "2", "--allow-runtime-lora-updating",
                            "--lora-modules", f"a0={adapter_dirs['a0']}"])
    server.wait_healthy(180)
    yield server
    server.stop()


def _complete(client, model: str, j: int) -> str:
    return client.completions.create(model=model, prompt=PROMPTS[j], max_tokens=MAX_TOKENS, temperature=0).choices[0].text


def _kv_usage(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    return float(re.search(r"^tokenforge:kv_cache_usage_perc(?:{[^}]*})? (\S+)$", text, re.MULTILINE).group(1))


def test_model_field_picks_the_adapter(live, expected):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {BASE, "a0"}
    assert models["a0"].parent == BASE and models[BASE].parent is None
    assert client.models.retrieve("a0").parent == BASE
    assert _complete(client, BASE, 0) == expected[None, 0]
    assert _complete(client, "a0", 0) == expected["a0", 0]
    with pytest.raises(openai.NotFoundError) as err:
        _complete(client, "a1", 0)
    assert err.value.body["code"] == "model_not_found" and "`a1` does not exist" in err.value.body["message"]


def test_runtime_load_use_unload_reload_under_load(live, expected, adapter_dirs):
    client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    http = httpx.Client(base_url=live.url, timeout=60)

    async def traffic(names: list, rounds: int) -> list[tuple[str, int, str]]:
        async def one(name, j):
            done = await client.completions.create(model=name or BASE, prompt=PROMPTS[j], max_tokens=MAX_TOKENS,
                                                   temperature=0)
            return name, j, done.choices[0].text
        jobs = [one(n, j) for _ in range(rounds) for n in names for j in range(len(PROMPTS))]
        return await asyncio.gather(*jobs)

    async def scenario():
        background = asyncio.ensure_future(traffic([None, "a0"], 3))        # the base and a0 keep running
        load = await asyncio.to_thread(http.post, "/v1/load_lora_adapter",
                                       json={"lora_name": "a1", "lora_path": adapter_dirs["a1"]})
        assert load.status_code == 200 and "a1" in load.text
        with_a1 = await traffic([None, "a0", "a1"], 2)                        # three adapters, two slots
        unload = await asyncio.to_thread(http.post, "/v1/unload_lora_adapter", json={"lora_name": "a1"})
        assert unload.status_code == 200
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="a1", prompt=PROMPTS[0], max_tokens=2, temperature=0)
        reload = await asyncio.to_thread(http.post, "/v1/load_lora_adapter",
                                         json={"lora_name": "a1", "lora_path": adapter_dirs["a1"]})
        assert reload.status_code == 200
        again = await traffic(["a1"], 1)
        return await background + with_a1 + again

    results = asyncio.run(scenario())
    assert len(results) == 6 * 3 + 6 * 3 + 3
    for name, j, text in results:
        assert text == expected[name, j], (name, j)
    assert _kv_usage(live) == 0.0                                # every block back in the pool
    assert {m["id"] for m in http.get("/v1/models").json()["data"]} == {BASE, "a0", "a1"}


def test_bad_runtime_updates_are_clear_errors(live, adapter_dirs, tmp_path):
    http = httpx.Client(base_url=live.url, timeout=60)
    cases = [
        ({"lora_name": "gone", "lora_path": str(tmp_path / "nope")}, 400, r"LoRA adapter 'gone': .*nope is not a directory"),
        ({"lora_name": "big", "lora_path": adapter_dirs["big"]}, 400,
         r"LoRA adapter 'big' has rank 16, more than --max-lora-rank 8"),
        ({"lora_name": "a0", "lora_path": adapter_dirs["a2"]}, 400, r"The LoRA adapter `a0` has already been loaded"),
        ({"lora_name": "x"}, 400, r"lora_path: Field required"),
        ({"lora_name": "", "lora_path": adapter_dirs["a2"]}, 400, r"Both 'lora_name' and 'lora_path' must be provided"),
        ({"lora_name": "x", "lora_path": ""}, 400, r"Both 'lora_name' and 'lora_path' must be provided"),
    ]
    for body, status, message in cases:
        r = http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == status and re.search(message, r.json()["error"]["message"]), r.text
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": ""})
    assert r.status_code == 400 and r.json()["error"]["message"] == ("'lora_name' needs to be provided to unload a "
                                                                     "LoRA adapter.")
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "never"})
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model `never` does not exist.", "type": "invalid_request_error",
                                  "param": "lora_name", "code": "model_not_found"}}
    assert http.get("/health").status_code == 200           # still serving


def test_runtime_updates_need_the_flag_and_bad_modules_stop_start_up(adapter_dirs, expected, tmp_path):
    # vLLM's JSON form of an entry beside the name=path one; base_model_name is the card's parent
    as_json = json.dumps({"name": "j1", "path": adapter_dirs["a1"], "base_model_name": "my-base"})
    server = ServerProcess([*SERVE, "--lora-modules", f"a0={adapter_dirs['a0']}", as_json])
    try:
        server.wait_healthy(180)
        parents = {m["id"]: m.get("parent") for m in httpx.get(server.url + "/v1/models").json()["data"]}
        assert parents == {BASE: None, "a0": BASE, "j1": "my-base"}
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        assert client.completions.create(model="j1", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                         temperature=0).choices[0].text == expected["a1", 0]
        r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": adapter_dirs["a1"]})
        assert r.status_code == 403 and r.json()["error"]["code"] == "lora_updating_disabled"
        assert "--allow-runtime-lora-updating" in r.json()["error"]["message"]
        assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "a0"}).status_code == 403
    finally:
        server.stop()
    bad = ServerProcess([*SERVE, "--lora-modules", f"x={tmp_path / 'missing'}"])
    assert bad.proc.wait(180) == 1
    assert re.search(r"--lora-modules: LoRA adapter 'x': .*missing is not a directory", bad.output())
    bad.stop()
