"""Several tokens per request per step through the engine's half: the engine core's loop, the
output processor (stop strings inside a list) and the grammar matchers (token by token)."""

from __future__ import annotations

from types import SimpleNamespace

from tests.core.core_fakes import assert_pool_idle, make_request, reference_generate
from tests.engine.engine_fakes import FakeGrammars, make_engine, run_engine
from tokenforge.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenforge.engine.output_processor import OutputProcessor
from tokenforge.engine.processor import ProcessedRequest
from tokenforge.engine.structured_output import GrammarMatchers
from tokenforge.messages import EngineCoreOutput, EngineCoreRequest, PositionLogprobs, WireSamplingParams
from tokenforge.sampling_params import SamplingParams


class _ByteTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def _processor(params: SamplingParams) -> OutputProcessor:
    proc = OutputProcessor(_ByteTokenizer(), stream_deltas=False)
    core = EngineCoreRequest("r", [ord("x")], WireSamplingParams(max_tokens=params.max_tokens))
    proc.add_request(ProcessedRequest("r", "x", [ord("x")], [core]), params)
    return proc


def test_a_stop_string_inside_a_list_drops_the_tokens_after_it():
    proc = _processor(SamplingParams(max_tokens=20, stop=["cd"], logprobs=0))
    ids = [ord(c) for c in "abcdef"]
    lps = [PositionLogprobs([t], [-1.0], [1]) for t in ids]
    step = proc.process_outputs([EngineCoreOutput("r", ids[:2], lps[:2]), EngineCoreOutput("r", ids[2:], lps[2:])])
    assert step.abort_ids == ["r"]               # the core must stop the request
    (out,) = step.request_outputs
    done = out.outputs[0]
    assert (done.text, done.token_ids, done.finish_reason, done.stop_reason) == ("ab", ids[:4], "stop", "cd")
    assert len(done.logprobs) == 4 and done.cumulative_logprob == -4.0


def test_lists_of_tokens_accumulate_in_order():
    proc = _processor(SamplingParams(max_tokens=5))
    ids = [ord(c) for c in "hello"]
    step = proc.process_outputs([EngineCoreOutput("r", ids[:3]), EngineCoreOutput("r", []),
                                 EngineCoreOutput("r", ids[3:], finish_reason="length")])
    assert [(o.outputs[0].text, o.outputs[0].token_ids) for o in step.request_outputs] == [("hello", ids)]


class _Matcher:
    """llguidance's matcher, reduced: accepts `allowed` tokens and stops after `length` of them."""

    def __init__(self, allowed: set[int], length: int) -> None:
        self.allowed, self.length, self.consumed = allowed, length, []

    def is_stopped(self) -> bool:
        return len(self.consumed) >= self.length

    def consume_token(self, token: int) -> bool:
        if token not in self.allowed:
            return False
        self.consumed.append(token)
        return True

    def get_error(self) -> str:
        return "not allowed"


def _sampling(rid: str) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, sample=True)


def test_the_grammar_advances_token_by_token_and_stops_where_it_completes():
    grammars = GrammarMatchers(lambda: None, vocab_size=64)
    a, b, c = _Matcher({1, 2, 3, 4}, 3), _Matcher({1, 2}, 10), _Matcher({5}, 10)
    grammars._matchers.update({"a": a, "b": b, "c": c})
    sched = SchedulerOutput([_sampling("a"), _sampling("b"), _sampling("c")])
    grammars.advance(sched, ModelRunnerOutput({"a": [1, 2], "b": [1, 2, 1], "c": []}))
    grammars.advance(sched, ModelRunnerOutput({"a": [3, 4, 4], "b": [2, 9, 1], "c": [5, 5]}))
    assert a.consumed == [1, 2, 3]               # complete after three: the rest is not fed
    assert b.consumed == [1, 2, 1, 2] and "b" not in grammars._matchers   # 9 broke it: dropped
    assert c.consumed == [5, 5]


def test_the_engine_loop_with_several_tokens_per_step(monkeypatch):
    """Scheduler, grammar advance and outputs with 3 tokens a step, an EOS inside a list."""
    engine = make_engine(monkeypatch, tokens_per_step=3)
    grammars = FakeGrammars({"g"}, engine.executor.events)
    engine.grammars = grammars
    prompt = [4, 9, 2]
    ref = reference_generate(prompt, 10)
    at = next(i for i in range(4, 10) if i % 3 and ref[i] not in ref[:i])
    engine.add_request(make_request("g", prompt, max_tokens=10))
    engine.add_request(make_request("e", prompt, max_tokens=10, eos=(ref[at],)))
    engine.add_request(make_request("m", [7, 7], max_tokens=5))
    tokens = run_engine(engine)
    assert tokens == {"g": ref, "e": ref[:at + 1], "m": reference_generate([7, 7], 5)}
    # The matcher saw every token the runner returned for its request, in order.
    assert grammars.consumed["g"][:10] == ref
    assert_pool_idle(engine.scheduler)
