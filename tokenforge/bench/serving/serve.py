"""W4 serving benchmark: Poisson arrivals over HTTP streaming against a running server.

    tokenforge serve --model llama-3.1-8b --load-format dummy &
    tokenforge bench serve --url http://127.0.0.1:8000 --request-rate 16 --num-prompts 300 \
        --input-len 1024 --output-len 1024
    # or let the bench start (and stop) the server itself:
    tokenforge bench serve --launch "--model llama-3.1-8b --load-format dummy --max-num-seqs 256"

Each request is a streamed /v1/completions call with random token-id prompts, `ignore_eos` and
max_tokens = output length, so lengths are forced. Inter-arrival gaps are exponential with mean
1/rate (rate inf: all at once). Per request: TTFT (first content chunk), ITL (gaps between content
chunks), TPOT ((e2e - TTFT) / (tokens - 1)) and the exact token count from the usage chunk.

Every run draws fresh prompts (a new seed unless --seed is given), so a second run against the
same server does not hit the prefix cache; the hit rate measured from the server's /metrics over
the timed run is in the JSON. Before timing, one request checks the forced length and bursts of
1, 2, 4, ... 32 (--warm-up-max-burst) concurrent fresh prompts warm every prefill shape (Triton
JIT, graph buckets).
Prints a table last; with --out or --results-dir also writes the results JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from tokenforge.bench.lib.serve_floor import latency_ms
from tokenforge.bench.serving.sse_client import DEFAULT_TIMEOUT_S, Endpoint, RequestResult, _one

DEFAULTS = {"url": "http://127.0.0.1:8000", "api_key": None, "model": None, "num_prompts": 300,
            "request_rate": 16.0, "input_len": 1024, "output_len": 1024, "seed": None, "max_concurrency": None,
            "token_id_range": "100,30000", "out": None, "results_dir": None, "timeout": DEFAULT_TIMEOUT_S,
            "launch": None, "warm_up_max_burst": 32}


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serve bench (W4)")
    g.add_argument("--url", default=DEFAULTS["url"], help="server base URL (default %(default)s)")
    g.add_argument("--api-key", default=None)
    g.add_argument("--model", default=None, help="served model name (default: the server's only model)")
    g.add_argument("--num-prompts", type=int, default=DEFAULTS["num_prompts"])
    g.add_argument("--request-rate", type=float, default=DEFAULTS["request_rate"],
                   help="mean arrivals per second, Poisson (inf: all at once)")
    g.add_argument("--input-len", type=int, default=DEFAULTS["input_len"])
    g.add_argument("--output-len", type=int, default=DEFAULTS["output_len"])
    g.add_argument("--seed", type=int, default=None,
                   help="prompt seed (default: a fresh one per run, so no prefix-cache hits carry over)")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    g.add_argument("--token-id-range", default=DEFAULTS["token_id_range"],
                   help="random prompt ids are drawn from [lo, hi) (avoids special tokens)")
    g.add_argument("--timeout", type=float, default=DEFAULTS["timeout"], help="per-request timeout, seconds")
    g.add_argument("--warm-up-max-burst", type=int, default=DEFAULTS["warm_up_max_burst"],
                   help="untimed warm-up bursts of 1, 2, 4, ... up to this many concurrent prompts "
                        "(default %(default)s; 0: only the forced-length check)")
    g.add_argument("--launch", default=None, metavar="SERVE_FLAGS",
                   help="start `tokenforge serve SERVE_FLAGS` on a free port for the run (instead of --url)")
    g.add_argument("--ceilings", default=None, metavar="READ_TBPS,MATMUL_TFLOPS",
                   help="the device's ceilings for the hardware floor of the run (default: measured before "
                        "--launch starts the server on a CUDA machine; none: no floor)")
    g.add_argument("--out", default=None, help="also write the results JSON here")
    g.add_argument("--results-dir", default=None, help="write the results JSON here (e.g. results/)")


def _opt(args, name: str):
    value = getattr(args, name, None)
    return DEFAULTS[name] if value is None else value


@dataclass(frozen=True, slots=True)
class Load:
    """One timed run's shape: how many requests, how fast, how long, from which seed."""

    num_prompts: int
    rate: float
    input_len: int
    output_len: int
    seed: int
    id_range: tuple[int, int] = (100, 30000)
    max_concurrency: int | None = None
    timeout: float = 3600.0
    api_key: str | None = None
    warm_up_max_burst: int = 32

    @staticmethod
    def from_args(args: argparse.Namespace, **overrides) -> Load:
        lo, hi = (int(x) for x in str(_opt(args, "token_id_range")).split(","))
        seed = _opt(args, "seed")
        fields = dict(num_prompts=_opt(args, "num_prompts"), rate=float(_opt(args, "request_rate")),
                      input_len=_opt(args, "input_len"), output_len=_opt(args, "output_len"),
                      seed=random.SystemRandom().randrange(2**31) if seed is None else seed,
                      id_range=(lo, hi), max_concurrency=_opt(args, "max_concurrency"),
                      timeout=_opt(args, "timeout"), api_key=getattr(args, "api_key", None),
                      warm_up_max_burst=_opt(args, "warm_up_max_burst"))
        return Load(**{**fields, **overrides})


def _prompts(rng: random.Random, load: Load, count: int) -> list[list[int]]:
    lo, hi = load.id_range
    return [[rng.randrange(lo, hi) for _ in range(load.input_len)] for _ in range(count)]


async def _warm_up(ep: Endpoint, model: str, load: Load, rng: random.Random) -> None:
    """Check the forced length, then compile every prefill shape: bursts of fresh prompts that
    arrive together, so steps with 1 to `warm_up_max_burst` (32) prefills and their chunks all run
    once untimed."""
    check_len = min(load.output_len, 32)
    warm = await _one(ep, model, _prompts(rng, load, 1)[0], check_len, load.timeout)
    if not warm.ok or warm.output_tokens != check_len:
        raise RuntimeError(f"warm-up request failed the forced-length check: {warm.error or warm.output_tokens}")
    burst = 1
    while burst <= load.warm_up_max_burst:
        results = await asyncio.gather(*[_one(ep, model, p, 2, load.timeout) for p in _prompts(rng, load, burst)])
        failed = [r.error for r in results if not r.ok]
        if failed:
            raise RuntimeError(f"warm-up burst of {burst} failed: {failed[0]}")
        burst *= 2


async def _prefix_counters(client: httpx.AsyncClient) -> tuple[float, float] | None:
    """(prompt tokens looked up, found) from the server's /metrics; None if it has none."""
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return None
    totals = {"queries": 0.0, "hits": 0.0}
    for line in text.splitlines():
        for key in totals:
            if line.startswith(f"tokenforge:prefix_cache_{key}_total"):
                totals[key] += float(line.rsplit(" ", 1)[1])
    return totals["queries"], totals["hits"]


async def _metric_sum(client: httpx.AsyncClient, name: str) -> float | None:
    """The sum of `tokenforge:<name>` over its label sets in /metrics; None if it has none."""
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"tokenforge:{name}{{")]
    return sum(values) if values else None


async def _await_graphs(client: httpx.AsyncClient, timeout: float = 60.0) -> None:
    """Wait until the server has captured its deferred CUDA graphs (it does so while idle after
    start-up), so the timed run replays graphs as a server that has been up a while does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pending = await _metric_sum(client, "cuda_graphs_pending")
        if not pending:
            return
        await asyncio.sleep(0.2)


def _hit_rate(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    if before is None or after is None or after[0] <= before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


async def _timed(ep: Endpoint, model: str, load: Load,
                 prompts: list[list[int]], rng: random.Random) -> tuple[list[RequestResult], float]:
    gate = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None

    async def gated(prompt):
        if gate is None:
            return await _one(ep, model, prompt, load.output_len, load.timeout)
        async with gate:
            return await _one(ep, model, prompt, load.output_len, load.timeout)

    tasks = []
    start = time.perf_counter()
    for prompt in prompts:
        tasks.append(asyncio.create_task(gated(prompt)))
        if not math.isinf(load.rate):
            await asyncio.sleep(rng.expovariate(load.rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def run(main):
    """Run a bench coroutine on uvloop when it is installed (a lighter client), else asyncio."""
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def run_load(url: str, model: str, load: Load, warm_up: bool = True) -> dict:
    """Warm up, then one timed run of `load` against `url`: the summary, seed and hit rate."""
    rng = random.Random(load.seed)
    ep = Endpoint(url, load.api_key)
    headers = {"Authorization": f"Bearer {load.api_key}"} if load.api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=load.timeout) as client:
        if warm_up:
            await _warm_up(ep, model, load, rng)
            await _await_graphs(client)
        prompts = _prompts(rng, load, load.num_prompts)
        before = await _prefix_counters(client)
        eager_before = await _metric_sum(client, "eager_decode_steps")
        results, duration = await _timed(ep, model, load, prompts, rng)
        first = min((r.start for r in results), default=0.0)
        after = await _prefix_counters(client)
        eager_after = await _metric_sum(client, "eager_decode_steps")
    eager = None if eager_before is None or eager_after is None else eager_after - eager_before
    return {"num_prompts": load.num_prompts, "request_rate": load.rate, "input_len": load.input_len,
            "output_len": load.output_len, "seed": load.seed, "prefix_hit_rate": _hit_rate(before, after),
            "eager_decode_steps": eager, "arrivals_s": [round(r.start - first, 6) for r in results],
            **summarize(results, duration, load.input_len)}


def summarize(results: list[RequestResult], duration: float, input_len: int) -> dict:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "output_tokens": out_tokens,
        "request_per_s": len(done) / duration, "output_tok_per_s": out_tokens / duration,
        "total_tok_per_s": (out_tokens + input_len * len(done)) / duration,
        "ttft_ms": latency_ms([r.ttft for r in done]), "tpot_ms": latency_ms(tpot),
        "itl_ms": latency_ms([gap for r in done for gap in r.itl]), "e2e_ms": latency_ms([r.e2e for r in done]),
    }


def _print(result: dict) -> None:
    from tokenforge.bench.lib.report import print_table  # noqa: PLC0415 - report imports torch

    rows = [[name, result[key]["mean"], result[key]["p50"], result[key]["p99"]]
            for name, key in (("TTFT ms", "ttft_ms"), ("TPOT ms", "tpot_ms"), ("ITL ms", "itl_ms"),
                              ("E2E ms", "e2e_ms"))]
    floor = result.get("floor")
    if floor:
        rows.append(["TPOT floor ms", "", floor["tpot_ms"]["p50"], floor["tpot_ms"]["p99"]])
        rows.append(["TTFT floor ms", "", floor["ttft_ms"]["p50"], floor["ttft_ms"]["p99"]])
    rows.append(["output tok/s", result["output_tok_per_s"], "", ""])
    rows.append(["requests/s", result["request_per_s"], "", ""])
    print_table(f"W4 serving: {result['completed']} ok, {result['failed']} failed, {result['request_rate']} req/s, "
                f"{result['input_len']} in / {result['output_len']} out", ["metric", "mean", "p50", "p99"], rows)


@contextlib.contextmanager
def _launched(flags: str | None, url: str, startup_timeout: float = 1800.0, env: dict[str, str] | None = None):
    """Yield the URL to benchmark: `url`, or that of a server started with `flags` (and `env`) and
    stopped after."""
    if flags is None:
        yield url
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tokenforge.cli", "serve", *shlex.split(flags), "--port", str(port)],
                            env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the launched server did not become healthy (exit code {proc.poll()})")
            time.sleep(1.0)
        yield url
    finally:
        proc.terminate()
        proc.wait(120)


def launch_flags(flags: str | None) -> dict:
    """The quality-relevant engine flags of a launched server (recorded in the result)."""
    names = {"--quantization": "quantization", "--kv-cache-dtype": "kv_cache_dtype", "--sparsity": "sparsity",
             "--prune-rate": "prune_rate", "--dtype": "dtype"}
    out: dict = {v: None for v in names.values()}
    words = shlex.split(flags or "")
    for i, word in enumerate(words):
        key, _, value = word.partition("=")
        if key in names:
            out[names[key]] = value or (words[i + 1] if i + 1 < len(words) else None)
    return out


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def main(args: argparse.Namespace) -> dict:
    ceilings = _ceilings(args)
    with _launched(getattr(args, "launch", None), _opt(args, "url")) as url:
        return _bench(args, url, ceilings)


def _ceilings(args: argparse.Namespace) -> dict | None:
    """--ceilings, else measured here before --launch starts a server on a CUDA machine."""
    given = getattr(args, "ceilings", None)
    if given:
        read, matmul = (float(x) for x in given.split(","))
        return {"read_bw_tbps": read, "matmul_tflops": matmul}
    if getattr(args, "launch", None) is None:
        return None
    import torch  # noqa: PLC0415 - only for a launched server's device

    if not torch.cuda.is_available():
        return None
    from tokenforge.bench.lib.ceilings import measure_ceilings  # noqa: PLC0415

    return measure_ceilings("cuda")


def _floor(args: argparse.Namespace, model: str, measured: dict, ceilings: dict | None) -> dict | None:
    """What an ideal engine gives the same arrivals on this device (bench/lib/serve_floor.py)."""
    from tokenforge.bench.lib.serve_floor import flag, floor_for_run  # noqa: PLC0415
    from tokenforge.bench.lib.workloads import load_config_dict  # noqa: PLC0415

    words = shlex.split(getattr(args, "launch", None) or "")
    try:
        config = load_config_dict(flag(words, "--model") or model)
    except (OSError, ValueError):
        config = None
    floor = floor_for_run(words, config, ceilings, measured["arrivals_s"], measured["input_len"],
                          measured["output_len"])
    if floor is not None and measured["tpot_ms"]["p50"] and floor["tpot_ms"]["p50"]:
        floor["tpot_p50_of_floor"] = floor["tpot_ms"]["p50"] / measured["tpot_ms"]["p50"]
    return floor


def served_model(url: str, api_key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]


def _bench(args: argparse.Namespace, url: str, ceilings: dict | None = None) -> dict:
    model = getattr(args, "model", None) or served_model(url, getattr(args, "api_key", None))
    measured = run(run_load(url, model, Load.from_args(args)))
    result = {"workload": "W4", "url": url, "served_model": model, "launch": getattr(args, "launch", None),
              "flags": launch_flags(getattr(args, "launch", None)), **measured, "ceilings": ceilings,
              "floor": _floor(args, model, measured, ceilings)}
    save_and_print(args, model, result, f"rate-{_opt(args, 'request_rate'):g}")
    return result


def save_and_print(args: argparse.Namespace, model: str, result: dict, tail: str) -> None:
    """The results JSON (with --out / --results-dir; its variant from the launch flags and `tail`),
    then the table."""
    if getattr(args, "out", None) or getattr(args, "results_dir", None):
        from tokenforge.bench.lib import report  # noqa: PLC0415

        parts = [f"{k}-{v}" for k, v in result["flags"].items() if v not in (None, "auto")]
        variant = "-".join([*parts, tail])
        report.save({**report.new_result(result["workload"], model, "server"), **result, "variant": variant}, args)
    _print(result.get("speculative", result))
