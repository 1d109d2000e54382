"""The engine-core wire format: every message and the config round-trip through msgpack."""

from __future__ import annotations

import msgspec

from tokenforge.config import EngineConfig
from tokenforge.engine.core_process import (
    AbortRequests,
    AddRequests,
    Fatal,
    InputMessage,
    OutputMessage,
    Ready,
    Rejected,
    ShutdownRequest,
    Stats,
    StatsRequest,
    StepOutputs,
    decode_config,
    encode_config,
)
from tokenforge.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineStats,
    PositionLogprobs,
    WireSamplingParams,
)


def test_messages_round_trip():
    request = EngineCoreRequest("r-0", [1, 2, 3], WireSamplingParams(temperature=0.5, stop_token_ids=(7,)),
                                eos_token_ids=(2,), cache_salt="tenant:x", arrival_time=1.5)
    inputs = [AddRequests([request]), AbortRequests(["r-0"]), StatsRequest(), ShutdownRequest()]
    output = EngineCoreOutput("r-0", [5], [PositionLogprobs([5, 6], [-0.1, -2.0], [1, 2])], None, "length")
    outputs = [Ready(123, 64, 49152, 2048), StepOutputs([output], 2.5), Rejected("r-0", "too long"),
               Stats(EngineStats(num_running=1, kv_usage=0.25)), Fatal("boom")]
    for messages, union in ((inputs, InputMessage), (outputs, OutputMessage)):
        decoder = msgspec.msgpack.Decoder(union)
        for message in messages:
            assert decoder.decode(msgspec.msgpack.encode(message)) == message


def test_config_round_trip_without_pickle():
    config = EngineConfig.from_kwargs(max_num_seqs=3, num_kv_blocks=17, kv_cache_memory="1GiB", device="cpu")
    data = encode_config(config)
    assert b"\x80\x04" not in data[:2]          # not a pickle protocol header
    assert decode_config(data) == config
