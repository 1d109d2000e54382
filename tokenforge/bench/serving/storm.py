"""`tokenforge bench storm`: many concurrent streams through `tokenforge router`, some clients
walking away, and then a check that nothing leaked.

    tokenforge bench storm --launch 3 --streams 1000 --max-tokens 16 --disconnect-frac 0.33
    tokenforge bench storm --router http://127.0.0.1:8080 --replica http://10.0.0.5:8000 ...

Every stream is a /v1/completions call with a fresh short prompt and max_tokens <= --max-tokens;
a `--disconnect-frac` share of the clients, picked at random, closes its connection at a random
moment (before the headers or mid-stream). Afterwards every replica must report 0 running, 0
waiting and 0 KV usage, and (for processes on this machine) the file descriptors of the replicas
and the router must be back to where they were. Pass: 0 responses with a 5xx status, 0 errors
for clients that stayed, everything settled, no leaked descriptors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import socket
import subprocess
import sys
import time

import httpx

_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
          "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()
_KEEPALIVE_S = 6.0       # the router's idle upstream connections expire after 5 s (--upstream-keepalive)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--launch", type=int, default=None, metavar="N",
                   help="start N `tokenforge serve` replicas (bundled model, CPU) and a router for the run")
    p.add_argument("--serve-flags", default="--device cpu --max-num-seqs 256",
                   help="flags of launched replicas (without --num-threads, each gets its share of the cores)")
    p.add_argument("--router", default=None, help="router URL (instead of --launch)")
    p.add_argument("--replica", nargs="*", default=[], help="replica URLs to check afterwards (with --router)")
    p.add_argument("--pids", nargs="*", type=int, default=[], help="local pids whose fds to check (with --router)")
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--disconnect-frac", type=float, default=1 / 3)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", default=None, help="also write the result JSON to this folder")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _client(client: httpx.AsyncClient, rng: random.Random, max_tokens: int, leave: bool) -> str:
    """One stream; 'ok', 'left' (walked away on purpose), '5xx', or an error description."""
    prompt = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 60)))
    body = {"prompt": prompt, "max_tokens": rng.randint(1, max_tokens), "temperature": 0.8, "stream": True}
    leave_after = rng.uniform(0.0, 3.0) if leave else None
    try:
        async with asyncio.timeout(leave_after):
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code >= 500:
                    return "5xx"
                if response.status_code != 200:
                    return f"HTTP {response.status_code}"
                lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        if len(lines) < 2 or lines[-1] != "data: [DONE]" or '"error"' in lines[-2]:
            return f"bad stream end: {lines[-2:]!r}"
        return "ok"
    except TimeoutError:
        return "left" if leave else "timeout"
    except httpx.HTTPError as err:
        return f"{type(err).__name__}: {err}"


async def run_storm(router: str, streams: int, max_tokens: int, disconnect_frac: float, seed: int) -> dict:
    rng = random.Random(seed)
    leaving = set(rng.sample(range(streams), int(streams * disconnect_frac)))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=router, limits=limits, timeout=httpx.Timeout(300.0)) as client:
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(_client(client, random.Random(rng.random()), max_tokens, i in leaving)
                                          for i in range(streams)))
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome] = counts.get(outcome, 0) + 1
    stayed_errors = sum(n for k, n in counts.items() if k not in ("ok", "left"))
    return {"streams": streams, "seconds": time.perf_counter() - t0, "outcomes": counts,
            "num_5xx": counts.get("5xx", 0), "errors_of_staying_clients": stayed_errors}


def settle(replicas: list[str], timeout: float = 60.0) -> dict[str, dict]:
    """Wait until every replica reports nothing running, waiting or held in KV; their last state."""
    deadline = time.monotonic() + timeout
    while True:
        states = {url: _engine_state(url) for url in replicas}
        idle = all(s.get("running") == 0 and s.get("waiting") == 0 and s.get("kv_usage") == 0 for s in states.values())
        if idle or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


def _engine_state(url: str) -> dict:
    from tokenforge.router.replicas import parse_metrics  # noqa: PLC0415

    try:
        return parse_metrics(httpx.get(f"{url}/metrics", timeout=5).text)
    except httpx.HTTPError as err:
        return {"error": str(err)}


def check(router: str, replicas: list[str], pids: list[int], args) -> dict:
    """Baseline fds, the storm, settling, fds again after idle connections expired (`args.idle_s`,
    longer than the router's --upstream-keepalive)."""
    idle_s = getattr(args, "idle_s", _KEEPALIVE_S)
    httpx.get(f"{router}/v1/models", timeout=30)
    time.sleep(idle_s)
    httpx.get(f"{router}/v1/models", timeout=30)         # the pool drops expired connections on use
    before = {pid: fd_count(pid) for pid in pids}
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    result = asyncio.run(run_storm(router, args.streams, args.max_tokens, args.disconnect_frac, seed))
    result["seed"] = seed
    result["replicas"] = settle(replicas)
    time.sleep(idle_s)
    httpx.get(f"{router}/v1/models", timeout=30)
    time.sleep(0.5)
    after = {pid: fd_count(pid) for pid in pids}
    result["fds"] = {str(pid): [before[pid], after[pid]] for pid in pids}
    result["leaked_fds"] = sum(max(0, after[p] - before[p]) for p in pids)
    result["settled"] = all(s.get("running") == 0 and s.get("waiting") == 0 and s.get("kv_usage") == 0
                            for s in result["replicas"].values())
    result["passed"] = (result["num_5xx"] == 0 and result["errors_of_staying_clients"] == 0
                        and result["settled"] and result["leaked_fds"] <= 2 * len(pids))
    return result


@contextlib.contextmanager
def launched_fleet(n: int, serve_flags: str):
    """N replicas and a prefix router on free local ports: (router URL, replica URLs, pids)."""
    procs, urls = [], []
    flags = serve_flags.split()
    if "--num-threads" not in flags:       # N replicas on one host: each its share, not all the cores
        flags += ["--num-threads", str(max(1, (os.cpu_count() or 1) // n))]
    try:
        for _ in range(n):
            port = _free_port()
            procs.append(subprocess.Popen([sys.executable, "-m", "tokenforge.cli", "serve", *flags,
                                           "--port", str(port), "--log-level", "warning"]))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            _wait_healthy(url, procs)
        port = _free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "tokenforge.cli", "router", "--replica", *urls,
                                       "--port", str(port), "--health-interval", "0.5", "--log-level", "warning"]))
        router = f"http://127.0.0.1:{port}"
        _wait_healthy(router, procs)
        yield router, urls, [p.pid for p in procs]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, procs: list, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a launched process exited while waiting for {url}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout} s")


def main(args: argparse.Namespace) -> dict:
    import logging  # noqa: PLC0415

    logging.getLogger("httpx").setLevel(logging.WARNING)      # not a line per request
    if args.launch:
        with launched_fleet(args.launch, args.serve_flags) as (router, replicas, pids):
            result = check(router, replicas, pids, args)
    else:
        result = check(args.router, args.replica, args.pids, args)
    if args.out:
        import json  # noqa: PLC0415

        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "storm.json"), "w") as f:
            json.dump(result, f, indent=2)
    print(f"storm: {result['streams']} streams in {result['seconds']:.1f} s; outcomes {result['outcomes']}; "
          f"5xx {result['num_5xx']}; settled {result['settled']}; fds {result['fds']}; "
          f"leaked {result['leaked_fds']}: {'PASS' if result['passed'] else 'FAIL'}")
    return result
