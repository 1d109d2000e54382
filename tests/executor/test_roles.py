"""Rank roles (executor/roles.py) and pipelined-step bookkeeping (executor/pipeline.py) against a
fake runner: no model, no process group. Every first-stage rank must run the LM head over the same
rows in the same order (they meet in its collectives); only the driver samples and collects."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenforge.config import EngineConfig
from tokenforge.core.outputs import ScheduledSequence, SchedulerOutput
from tokenforge.distributed.parallel_state import ParallelRank
from tokenforge.executor import roles
from tokenforge.executor.input_batch import PreviousSample, build_inputs
from tokenforge.executor.pipeline import PipelinedSteps
from tokenforge.executor.roles import Driver, LaterStage, StepInFlight, TPFollower, make_role
from tokenforge.messages import WireSamplingParams

VOCAB, HIDDEN = 16, 4


class FakeModel:
    """compute_logits: logits whose argmax is the first hidden feature (as an id); calls logged."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls.append(hidden.shape[0])
        return torch.nn.functional.one_hot(hidden[:, 0].long(), VOCAB).float() * 5.0


def fake_runner(rank: ParallelRank) -> SimpleNamespace:
    config = EngineConfig.from_kwargs(model="tiny-llama", load_format="dummy", device="cpu", max_num_seqs=4)
    return SimpleNamespace(rank=rank, device=torch.device("cpu"), model=FakeModel(), previous=PreviousSample(),
                           vocab_size=VOCAB, config=config)


def _seq(rid: str, tokens: list[int], start: int = 0, sample: bool = True, prompt_logprobs: int | None = None):
    params = WireSamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=prompt_logprobs)
    prompt = list(range(1, start + len(tokens) + 1))
    return ScheduledSequence(rid, tokens, start, [0, 1], sample, params, prompt, [],
                             want_prompt_logprobs=prompt_logprobs is not None)


def _step(runner, seqs) -> StepInFlight:
    """A launched step after its forward: hidden row t holds the id (t + 3) % VOCAB."""
    sched = SchedulerOutput(seqs)
    step = StepInFlight(sched, build_inputs(seqs, 4, runner.device))
    n = step.inputs.num_tokens
    step.hidden = torch.zeros(n, HIDDEN)
    step.hidden[:, 0] = (torch.arange(n) + 3) % VOCAB
    step.sampling = [s for s in seqs if s.sample]
    return step


def _batch():
    # a decode, a prefill chunk that samples, a prefill chunk that does not (with prompt logprobs)
    return [_seq("a", [5], start=3), _seq("b", [1, 2, 3]), _seq("c", [4, 4], sample=False, prompt_logprobs=1)]


@pytest.mark.parametrize("rank,kind", [
    (ParallelRank(0, 2, 2, 0), Driver), (ParallelRank(1, 2, 2, 1), TPFollower),
    (ParallelRank(2, 2, 2, 2), LaterStage), (ParallelRank(3, 2, 2, 3), LaterStage),
])
def test_each_rank_gets_its_role_once(rank, kind):
    assert type(make_role(fake_runner(rank))) is kind


def test_the_driver_samples_copies_back_and_collects_lists():
    runner = fake_runner(ParallelRank(0, 1, 1, 0))
    driver = make_role(runner)
    step = _step(runner, _batch())
    driver.after_forward(step, defer_sampling=False)
    # rows: a's last token is hidden row 0 -> 3; b's is row 3 -> 6
    assert runner.previous.tokens.tolist() == [3, 6] and not step.sample_pending
    assert runner.model.calls == [2, 1]          # the sampling rows, then c's one prompt-logprob row
    out = roles.ModelRunnerOutput()
    driver.collect(step, out)
    assert out.sampled_token_ids == {"a": [3], "b": [6]}
    assert list(out.prompt_logprobs) == ["c"] and len(out.prompt_logprobs["c"]) == 1


def test_a_deferred_sampling_waits_for_sample_and_blocks_the_next_launch():
    runner = fake_runner(ParallelRank(0, 1, 1, 0))
    driver = make_role(runner)
    step = _step(runner, _batch())
    driver.after_forward(step, defer_sampling=True)
    assert step.sample_pending and step.sampler_output is None and runner.model.calls == [2, 1]
    with pytest.raises(RuntimeError, match="before the previous one was sampled"):
        driver.check_launch()
    mask = driver.grammar_bitmask_buffer(1, 1)
    mask[:] = 1 << 9                             # row "b" may only sample token 9
    driver.sample(step, SchedulerOutput(step.sched.sequences, grammar_rows=[1], grammar_bitmask=mask))
    driver.check_launch()
    out = roles.ModelRunnerOutput()
    driver.collect(step, out)
    assert out.sampled_token_ids == {"a": [3], "b": [9]} and runner.model.calls == [2, 1]


def test_a_tp_follower_joins_the_same_lm_head_calls_and_takes_the_broadcast(monkeypatch):
    broadcasts = []
    monkeypatch.setattr(roles.torch.distributed, "broadcast", lambda t, src, group: broadcasts.append(t.shape))
    monkeypatch.setattr(roles.parallel_state, "tp_group", lambda: None)
    driver_runner = fake_runner(ParallelRank(0, 2, 1, 0))
    follower_runner = fake_runner(ParallelRank(1, 2, 1, 1))
    make_role(driver_runner).after_forward(_step(driver_runner, _batch()), defer_sampling=False)
    make_role(follower_runner).after_forward(_step(follower_runner, _batch()), defer_sampling=False)
    assert follower_runner.model.calls == driver_runner.model.calls == [2, 1]
    assert broadcasts == [torch.Size([2]), torch.Size([2])]     # rank 0 sends, the follower receives
    assert follower_runner.previous.tokens.shape == (2,)


def test_a_later_stage_does_nothing_after_its_forward():
    runner = fake_runner(ParallelRank(1, 1, 2, 1))
    step = _step(runner, _batch())
    make_role(runner).after_forward(step, defer_sampling=False)
    assert runner.model.calls == [] and runner.previous.tokens is None and step.host is None


def test_placeholders_read_the_previous_sample_on_the_device():
    prev = PreviousSample()
    prev.rows, prev.tokens = {"a": 1, "b": 0}, torch.tensor([11, 12])
    seqs = [_seq("a", [-1], start=3), _seq("b", [7, -1], start=2)]
    inputs = build_inputs(seqs, 4, torch.device("cpu"), prev_rows=prev.rows)
    prev.fill(inputs)
    assert inputs.input_ids.tolist() == [12, 7, 11]


class FakeStages:
    def __init__(self) -> None:
        self.started: list[int] = []

    def start(self, model, input_ids, positions):
        self.started.append(input_ids.shape[0])
        return input_ids.shape[0]

    @staticmethod
    def finish(pending):
        return torch.full((pending, HIDDEN), float(pending))


def test_pipelined_steps_finish_oldest_first():
    runner = fake_runner(ParallelRank(0, 1, 2, 0))
    pipeline = PipelinedSteps(FakeStages())
    first, second = _step(runner, [_seq("a", [1, 2, 3])]), _step(runner, [_seq("b", [4])])
    for step in (first, second):
        step.hidden = None
        pipeline.start(None, None, step)
        assert step.awaits_last_stage
    assert pipeline.stages.started == [3, 1]
    done = pipeline.finish_oldest()
    assert done is first and not first.awaits_last_stage and first.hidden.shape == (3, HIDDEN)
    assert second.awaits_last_stage and pipeline.finish_oldest() is second
