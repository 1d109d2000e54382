"""CUDA-graph capture in two stages (executor/graph_stages.py), driven by the engine core's idle
loop: the small buckets before Ready, the rest only while no request is queued or running, a
decode batch without its graph run eagerly (and counted), the same tokens either way.

The capture is a fake callable here (the policy is torch-free); tests/executor/test_staged_graphs_gpu.py
runs the real one."""

from __future__ import annotations

import os
import threading
import time

import msgspec
import pytest
import zmq

from tests.core.core_fakes import make_request, reference_generate
from tests.engine.engine_fakes import make_engine, run_engine
from tokenforge.engine.core_process import AddRequests, CoreLoop, OutputMessage, ShutdownRequest, StatsRequest, Stats
from tokenforge.executor.graph_stages import StagedCapture

SIZES = (1, 2, 4, 8, 16, 32)


def test_stage_one_is_the_small_buckets_and_the_rest_come_smallest_first():
    captured = []
    stages = StagedCapture(SIZES, captured.append, defer=True)
    stages.capture_initial()
    assert captured == [8, 4, 2, 1] and stages.pending == [16, 32]
    assert [stages.bucket(n) for n in (1, 3, 8)] == [1, 4, 8]
    assert stages.bucket(9) is None and stages.bucket(30) is None and stages.eager_decode_steps == 2
    assert stages.capture_next() and captured[-1] == 16 and stages.bucket(9) == 16
    assert not stages.capture_next() and captured[-1] == 32 and stages.bucket(30) == 32
    assert not stages.capture_next() and len(captured) == len(SIZES)          # nothing left: a no-op
    assert stages.bucket(33) is None and stages.eager_decode_steps == 2        # above every bucket: not a miss


def test_a_lone_requests_verify_bucket_is_in_stage_one():
    captured = []
    stages = StagedCapture(SIZES + (17,), captured.append, defer=True, first=[17])
    stages.capture_initial()
    assert captured == [17, 8, 4, 2, 1] and stages.pending == [16, 32]


def test_without_deferral_every_bucket_is_captured_at_start_up():
    captured = []
    stages = StagedCapture(SIZES, captured.append, defer=False)
    stages.capture_initial()
    assert captured == sorted(SIZES, reverse=True) and not stages.pending and stages.bucket(17) == 32


def _prompts(n: int) -> dict[str, list[int]]:
    return {f"r{i}": [3 + i, 5, 7 + i % 5] for i in range(n)}


@pytest.mark.parametrize("defer", [True, False])
def test_batches_without_a_graph_run_eagerly_with_the_same_tokens(monkeypatch, defer):
    engine = make_engine(monkeypatch, num_blocks=256, max_num_seqs=16, max_num_batched_tokens=64,
                         graph_sizes=SIZES, defer_graphs=defer)
    executor = engine.executor
    for rid, prompt in _prompts(12).items():
        engine.add_request(make_request(rid, prompt, max_tokens=5))
    assert run_engine(engine) == {rid: reference_generate(p, 5) for rid, p in _prompts(12).items()}
    stats = engine.get_stats()
    if defer:     # 12 decodes a step: bucket 16, not captured before Ready
        assert None in executor.decode_buckets and stats.eager_decode_steps == executor.decode_buckets.count(None)
        assert stats.cuda_graphs_pending == 2
        assert engine.idle_work() and not engine.idle_work() and engine.get_stats().cuda_graphs_pending == 0
    else:
        assert None not in executor.decode_buckets and stats.eager_decode_steps == 0
        assert stats.cuda_graphs_pending == 0 and not engine.idle_work()


def test_the_core_loop_captures_deferred_graphs_only_while_idle(monkeypatch):
    """The real CoreLoop over zmq: every deferred capture happens with no request in the engine,
    the requests' tokens are the reference, and once the loop has been idle every bucket is captured."""
    holder = {}
    busy_captures = []

    def check(size: int) -> None:
        engine = holder.get("engine")
        if engine is not None and engine.has_unfinished_requests():
            busy_captures.append(size)
        time.sleep(0.02)                 # a capture takes a while: requests may arrive meanwhile

    engine = make_engine(monkeypatch, num_blocks=256, max_num_seqs=16, max_num_batched_tokens=64,
                         graph_sizes=SIZES + (48, 64), capture_check=check)
    holder["engine"] = engine
    context = zmq.Context()
    addr_in, addr_out = f"inproc://in-{os.getpid()}", f"inproc://out-{os.getpid()}"
    frontend_in, frontend_out = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    frontend_in.bind(addr_in)
    frontend_out.bind(addr_out)
    core_in, core_out = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    core_in.connect(addr_in)
    core_out.connect(addr_out)
    loop = CoreLoop(engine, core_in, core_out, os.getppid())
    thread = threading.Thread(target=loop.run)
    thread.start()
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(OutputMessage)
    prompts = _prompts(12)
    try:
        frontend_in.send(encoder.encode(AddRequests([make_request(r, p, max_tokens=5) for r, p in prompts.items()])))
        tokens: dict[str, list[int]] = {}
        deadline = time.monotonic() + 60
        while sum(len(t) for t in tokens.values()) < 5 * len(prompts) and time.monotonic() < deadline:
            if frontend_out.poll(1000):
                message = decoder.decode(frontend_out.recv())
                for out in getattr(message, "outputs", []):
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert tokens == {rid: reference_generate(p, 5) for rid, p in prompts.items()}
        pending = None
        while time.monotonic() < deadline:       # idle now: the loop captures what is left
            frontend_in.send(encoder.encode(StatsRequest()))
            while frontend_out.poll(1000):
                message = decoder.decode(frontend_out.recv())
                if isinstance(message, Stats):
                    pending = message.stats.cuda_graphs_pending
            if pending == 0:
                break
        assert pending == 0
    finally:
        frontend_in.send(encoder.encode(ShutdownRequest()))
        thread.join(30)
        for sock in (frontend_in, frontend_out, core_in, core_out):
            sock.close(linger=0)
        context.term()
    assert not busy_captures, f"captured while requests ran: {busy_captures}"
    captures = [e[1] for e in engine.executor.events if e[0] == "capture"]
    assert sorted(captures) == sorted(SIZES + (48, 64)) and captures[4:] == [16, 32, 48, 64]


def test_the_graph_counts_reach_metrics():
    from tokenforge.messages import EngineStats
    from tokenforge.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.update_engine(EngineStats(cuda_graphs_pending=3, eager_decode_steps=41))
    text = metrics.render().decode()
    assert 'tokenforge:cuda_graphs_pending{model_name="m"} 3.0' in text
    assert 'tokenforge:eager_decode_steps{model_name="m"} 41.0' in text
