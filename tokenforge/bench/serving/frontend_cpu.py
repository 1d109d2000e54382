"""The API server's own cost on the CPU, with no model: `python -m tokenforge.bench.serving.frontend_cpu`.

    python -m tokenforge.bench.serving.frontend_cpu --streams 256 --output-len 1024 --step-ms 25

The real `tokenforge serve` stack (uvicorn, the HTTP app, AsyncEngine, detokenization, the ZMQ
hop, the engine-core process and its loop) runs around `PacedCore`, an engine core that emits
one token for every running request per step, on a fixed step period, as a GPU would (256
streams at 25 ms per step is ~10k tokens/s, an H200 on Llama-3.1-8B). The tokenizer is the one
`--model` gives the server (default: dummy Llama-3.1-8B, the synthetic tokenizer of the GPU
bench; `--model` unset with `--load-format auto` is the bundled SmolLM2's HF tokenizer).

A separate client process opens `--streams` streaming /v1/completions at once with a raw
asyncio HTTP/1.1 client (no JSON parsing per chunk: it counts SSE events and reads the usage
chunk), so it costs the server's core as little as possible. Reported: output tokens/s and
SSE chunks/s delivered, the engine's own pace (the ceiling), and the CPU seconds the API
process and the engine-core process spent per output token (from /proc, so they hold on a
2-core machine where the client competes for the CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time

from tokenforge import envs
from tokenforge.messages import EngineCoreOutput, EngineCoreRequest, EngineStats

STEP_MS_ENV = envs.PACED_STEP_MS
CORE_PATH = "tokenforge.bench.serving.frontend_cpu:PacedCore"


class PacedCore:
    """An engine core with the EngineCore contract and no model: each step, every running
    request (up to max_num_seqs) gets one token, and steps start every `step_ms` (the step
    sleeps what is left of its period, as the engine waits on the GPU). Tokens are ids in
    [1000, vocab) from a fixed pattern, so both tokenizers decode them to plain text."""

    def __init__(self, config) -> None:
        self.config = config
        self.num_kv_blocks = 1 << 16
        self.block_size = config.cache.block_size
        self.max_model_len = config.model.max_model_len or 4096
        self.vocab_size = envs.paced_vocab()
        self.step_s = envs.paced_step_ms() / 1000
        self.max_seqs = config.scheduler.max_num_seqs
        self.waiting: list[EngineCoreRequest] = []
        self.running: dict[str, list] = {}      # id -> [request, tokens produced]
        self.next_step = 0.0
        self.steps = 0

    def add_request(self, request: EngineCoreRequest) -> None:
        self.waiting.append(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        ids = set(request_ids)
        self.waiting = [r for r in self.waiting if r.request_id not in ids]
        for rid in ids:
            self.running.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[EngineCoreOutput]:
        while self.waiting and len(self.running) < self.max_seqs:
            request = self.waiting.pop(0)
            self.running[request.request_id] = [request, 0]
        now = time.monotonic()
        if self.next_step > now:
            time.sleep(self.next_step - now)
        self.next_step = max(now, self.next_step) + self.step_s
        self.steps += 1
        span = self.vocab_size - 1000
        outputs = []
        for rid, entry in list(self.running.items()):
            request, produced = entry
            token = 1000 + (produced * 7919 + len(rid) * 31 + self.steps) % span
            entry[1] = produced = produced + 1
            done = produced >= request.params.max_tokens
            outputs.append(EngineCoreOutput(rid, [token], finish_reason="length" if done else None))
            if done:
                del self.running[rid]
        return outputs

    def get_stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.running), num_waiting=len(self.waiting),
                           num_kv_blocks=self.num_kv_blocks, num_free_blocks=self.num_kv_blocks)

    def shutdown(self) -> None:
        pass


# ---- the server process ------------------------------------------------------------------------

def _serve_main(argv: list[str]) -> int:
    from tokenforge.cli.engine_args import add_engine_args, engine_kwargs  # noqa: PLC0415 - a process entry point
    from tokenforge.config import EngineConfig  # noqa: PLC0415
    from tokenforge.logs import configure_logging  # noqa: PLC0415
    from tokenforge.server.app import _run_loop, serve  # noqa: PLC0415
    from tokenforge.cli.serve import add_server_args  # noqa: PLC0415
    from tokenforge.server.settings import ServerSettings  # noqa: PLC0415

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = add_server_args(parser).parse_args(argv)
    settings = ServerSettings.from_args(args)
    configure_logging(settings.log_level, "api")
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    return _run_loop(serve(config, settings, core_path=CORE_PATH))


# ---- the client process ------------------------------------------------------------------------

_USAGE = re.compile(rb'"completion_tokens":(\d+)')


async def _stream(host: str, port: int, body: bytes, result: dict) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        result["failed"] += 1
        writer.close()
        return
    events, tail, tokens = 0, b"", None
    while True:
        data = await reader.read(1 << 16)
        if not data:
            break
        buf = tail + data
        events += buf.count(b"data: {") - tail.count(b"data: {")
        if b"data: [DONE]" in buf:
            found = _USAGE.findall(buf)
            tokens = int(found[-1]) if found else None
            break
        tail = buf[-4096:]
    writer.close()
    if tokens is None:
        result["failed"] += 1
        return
    result["tokens"] += tokens
    result["chunks"] += events - 1       # the usage chunk carries no token
    result["done"].append(time.perf_counter())


async def _client(host: str, port: int, streams: int, input_len: int, output_len: int) -> dict:
    result = {"tokens": 0, "chunks": 0, "failed": 0, "done": []}

    def body(i: int) -> bytes:
        prompt = [1000 + (i * 131 + k * 17) % 20000 for k in range(input_len)]
        return json.dumps({"prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()

    bodies = [body(i) for i in range(streams)]
    start = time.perf_counter()
    await asyncio.gather(*[_stream(host, port, b, result) for b in bodies])
    end = max(result["done"], default=time.perf_counter())
    result["duration_s"] = end - start
    del result["done"]
    return result


async def _bench_client(host: str, port: int, streams: int, input_len: int, output_len: int) -> dict:
    """The GPU bench's own client (tokenforge.bench.serving.serve: raw HTTP/1.1, one json.loads per SSE event)."""
    from tokenforge.bench.serving import serve  # noqa: PLC0415

    url = f"http://{host}:{port}"
    load = serve.Load(num_prompts=streams, rate=float("inf"), input_len=input_len, output_len=output_len,
                      seed=1, id_range=(1000, 21000))
    out = await serve.run_load(url, serve.served_model(url), load, warm_up=False)
    return {"tokens": out["output_tokens"], "chunks": 0, "failed": out["failed"], "duration_s": out["duration_s"]}


def _client_main(argv: list[str]) -> int:
    import resource  # noqa: PLC0415

    kind, host, port = argv[0], argv[1], int(argv[2])
    streams, input_len, output_len = int(argv[3]), int(argv[4]), int(argv[5])
    from tokenforge.bench.serving import serve  # noqa: PLC0415

    client = _client if kind == "raw" else _bench_client
    result = serve.run(client(host, port, streams, input_len, output_len))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["client_cpu_s"] = usage.ru_utime + usage.ru_stime
    print(json.dumps(result), flush=True)
    return 0


# ---- the driver --------------------------------------------------------------------------------

def _cpu_seconds(pid: int) -> float:
    """On-CPU seconds of a process's live threads, in nanoseconds from each task's schedstat: the
    clock-tick counts in /proc/PID/stat (10 ms) read 0 for a short run's API process (idle CI: a
    68 ms run). Falls back to those ticks where schedstat is missing."""
    total, tasks = 0, f"/proc/{pid}/task"
    try:
        for task in os.listdir(tasks):
            with open(f"{tasks}/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    import httpx  # noqa: PLC0415

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server not healthy in time")


def _run_client(port: int, streams: int, input_len: int, output_len: int, kind: str = "raw") -> dict:
    out = subprocess.run([sys.executable, "-m", "tokenforge.bench.serving.frontend_cpu", "--client", kind, "127.0.0.1",
                          str(port), str(streams), str(input_len), str(output_len)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--step-ms", type=float, default=25.0, help="the paced core's step period")
    p.add_argument("--model", default="llama-3.1-8b", help="whose tokenizer the server loads ('' = bundled)")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--serve-flags", default="", help="extra `serve` flags (e.g. --api-server-count 2)")
    p.add_argument("--profile", default=None, help="py-spy record the API process: .svg flamegraph, .json speedscope, .txt collapsed stacks")
    p.add_argument("--client", default="raw", choices=["raw", "bench"],
                   help="raw: a light asyncio client that counts events; bench: tokenforge.bench.serving.serve's client (times every chunk)")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)

    port = _free_port()
    model = ["--model", args.model] if args.model else []
    flags = [*model, "--load-format", args.load_format, "--max-num-seqs", str(max(args.streams, 1)),
             "--max-model-len", str(args.input_len + args.output_len + 16), "--port", str(port),
             "--log-level", "warning", "--max-queued-requests", "4096", *args.serve_flags.split()]
    env = envs.child_env(**{STEP_MS_ENV: str(args.step_ms)})
    server = subprocess.Popen([sys.executable, "-m", "tokenforge.bench.serving.frontend_cpu", "--serve", *flags], env=env)
    spy = None
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", server)
        _run_client(port, min(args.streams, 16), 16, 32)           # warm-up
        pids = [server.pid, *_children(server.pid)]
        pids = pids + [c for pid in pids[1:] for c in _children(pid)]
        before = {pid: _cpu_seconds(pid) for pid in pids}
        if args.profile:
            spy = subprocess.Popen(["py-spy", "record", "-o", args.profile, "-p", str(server.pid), "-r", "200",
                                    "--format", {"json": "speedscope", "txt": "raw"}.get(args.profile.rsplit(".", 1)[-1], "flamegraph")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result = _run_client(port, args.streams, args.input_len, args.output_len, args.client)
        after = {pid: _cpu_seconds(pid) for pid in pids}
    finally:
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
        server.terminate()
        server.wait(30)
    tokens = max(result["tokens"], 1)
    api_cpu = after[server.pid] - before[server.pid]
    core_cpu = sum(after[p] - before[p] for p in pids if p != server.pid)
    ceiling = args.streams / (args.step_ms / 1000)
    summary = {
        "streams": args.streams, "input_len": args.input_len, "output_len": args.output_len, "step_ms": args.step_ms,
        "model": args.model, "serve_flags": args.serve_flags, "failed": result["failed"],
        "output_tokens": result["tokens"], "duration_s": round(result["duration_s"], 3),
        "output_tok_per_s": round(result["tokens"] / result["duration_s"], 1),
        "chunks_per_s": round(result["chunks"] / result["duration_s"], 1),
        "tokens_per_chunk": round(result["tokens"] / max(result["chunks"], 1), 3),
        "engine_pace_tok_per_s": round(ceiling, 1),
        "client": args.client, "client_cpu_us_per_token": round(1e6 * result["client_cpu_s"] / tokens, 1),
        "api_cpu_s": round(api_cpu, 2), "api_cpu_us_per_token": round(1e6 * api_cpu / tokens, 1),
        "core_cpu_s": round(core_cpu, 2), "core_cpu_us_per_token": round(1e6 * core_cpu / tokens, 1),
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        sys.exit(_serve_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        sys.exit(_client_main(sys.argv[2:]))
    main()
