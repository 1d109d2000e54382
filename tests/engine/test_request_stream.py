"""RequestStream coalescing, the drain's explicit abort, and its metric (no model, milliseconds)."""

from __future__ import annotations

import asyncio

from tokenforge.engine.output_processor import OutputProcessor
from tokenforge.engine.processor import ProcessedRequest
from tokenforge.engine.request_stream import RequestStream
from tokenforge.messages import CompletionOutput, EngineCoreOutput, EngineCoreRequest, RequestOutput, WireSamplingParams
from tokenforge.sampling_params import SamplingParams
from tokenforge.server.app import ServerState
from tokenforge.server.metrics import ServerMetrics


class _ByteTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class _Engine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _delta(text: str, ids: list[int], finish: str | None = None, index: int = 0) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], [CompletionOutput(index, text, ids, None, None, finish)],
                         finished=finish is not None, metrics={"queue_time": 0.5})


def test_a_lagging_consumer_gets_queued_deltas_merged_in_order():
    async def run():
        stream = RequestStream(_Engine(), "r", 0.0, ["r"])
        for i, ch in enumerate("abc"):
            stream.put(_delta(ch, [i]))
        first = await stream.__anext__()
        stream.put(_delta("d", [3], finish="length"))
        stream.put(_delta("late", [9]))           # after the finish: never merged in
        last = await stream.__anext__()
        return first, last, stream

    first, last, stream = asyncio.run(run())
    assert (first.outputs[0].text, first.outputs[0].token_ids, first.finished) == ("abc", [0, 1, 2], False)
    assert first.metrics["queue_time"] == 0.5
    assert (last.outputs[0].text, last.outputs[0].finish_reason, last.finished) == ("d", "length", True)
    assert stream.finished


def test_an_error_behind_outputs_is_raised_after_them():
    async def run():
        stream = RequestStream(_Engine(), "r", 0.0, ["r"])
        stream.put(_delta("a", [0]))
        stream.put(RuntimeError("core died"))
        out = await stream.__anext__()
        try:
            await stream.__anext__()
        except RuntimeError as err:
            return out, str(err)

    out, error = asyncio.run(run())
    assert out.outputs[0].text == "a" and error == "core died"


def test_finish_aborted_releases_held_text_and_names_the_children():
    processor = OutputProcessor(_ByteTokenizer(), stream_deltas=True)
    core = EngineCoreRequest("r-0", list(b"hi"), WireSamplingParams(max_tokens=50))
    processed = ProcessedRequest("r", "hi", list(b"hi"), [core])
    processor.add_request(processed, SamplingParams(max_tokens=50, stop=["xyz"]))
    out = processor.process_outputs([EngineCoreOutput("r-0", list(b"abx"))])
    assert out.request_outputs[0].outputs[0].text == "ab"          # "x" held back: maybe "xyz"
    final, children = processor.finish_aborted("r")
    assert children == ["r-0"] and final.finished
    assert (final.outputs[0].text, final.outputs[0].finish_reason) == ("x", "abort")
    assert not processor.has_unfinished()
    assert processor.finish_aborted("r") == (None, [])


def test_the_drain_counts_the_requests_it_cuts():
    class Engine:
        def abort_all(self, reason: str) -> int:
            return 3

    state = ServerState(Engine())
    state.metrics = ServerMetrics("m")
    assert state._drain_expired() == 3
    assert b'tokenforge:num_requests_drain_aborted_total{model_name="m"} 3.0' in state.metrics.render()


def _stream_tokens(processor: OutputProcessor, n: int, steps: list[list[int]], stop: list[str] | None = None):
    """Feed one request (n samples) one step at a time; return, per step, the deltas released."""
    cores = [EngineCoreRequest(f"r-{i}", list(b"hi"), WireSamplingParams(max_tokens=50)) for i in range(n)]
    processor.add_request(ProcessedRequest("r", "hi", list(b"hi"), cores), SamplingParams(n=n, max_tokens=50, stop=stop))
    released = []
    for k, ids in enumerate(steps):
        last = k == len(steps) - 1
        outs = [EngineCoreOutput(f"r-{i}", [ids[i]] if i < len(ids) else [],
                                 finish_reason="length" if last else None) for i in range(n)]
        got = processor.process_outputs(outs).request_outputs
        released.append([(c.index, c.text, c.finish_reason) for o in got for c in o.outputs])
    return released


def test_stream_interval_releases_the_first_token_then_every_k_then_the_finish():
    steps = [[ord(ch)] for ch in "abcdefg"]
    every = _stream_tokens(OutputProcessor(_ByteTokenizer(), stream_deltas=True), 1, steps)
    assert every == [[(0, ch, None)] for ch in "abcdef"] + [[(0, "g", "length")]]     # the default: per token
    by3 = _stream_tokens(OutputProcessor(_ByteTokenizer(), stream_deltas=True, stream_interval=3), 1, steps)
    assert by3 == [[(0, "a", None)], [], [], [(0, "bcd", None)], [], [], [(0, "efg", "length")]]
    assert "".join(t for step in by3 for _, t, _ in step) == "abcdefg"


def test_stream_interval_releases_a_stop_string_finish_at_once():
    steps = [[ord(ch)] for ch in "abXYZcd"]
    got = _stream_tokens(OutputProcessor(_ByteTokenizer(), stream_deltas=True, stream_interval=10), 1, steps,
                         stop=["XYZ"])
    assert got[0] == [(0, "a", None)] and got[1] == []
    assert got[4] == [(0, "b", "stop")]            # the stop string ends it at the step it completes
    assert not any(got[5:])


def test_stream_interval_must_be_positive():
    import pytest

    with pytest.raises(ValueError, match="stream_interval"):
        OutputProcessor(_ByteTokenizer(), stream_deltas=True, stream_interval=0)
