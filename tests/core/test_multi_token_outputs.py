"""Runner outputs are lists per request: several tokens per step, through the scheduler.

Nothing produces more than one token per step yet (speculative decoding will). The fake runner
returns `tokens_per_step` tokens that continue its deterministic function, so every run must give
the reference tokens; a stop token, max_tokens or the length cap in the middle of a list ends the
request there, and the pool is full again afterwards (no leaked blocks).
"""

from __future__ import annotations

import pytest

from tokenforge.core.outputs import ModelRunnerOutput
from tokenforge.messages import PositionLogprobs

from .core_fakes import (FakeRunner, assert_pool_idle, make_request, make_scheduler, reference_generate,
                         run_to_completion)

PROMPTS = {"a": [1, 2, 3], "b": [4, 5, 6, 7, 8, 9, 10], "c": [11] * 13, "d": [2, 3]}


def _run(sched, k: int):
    return run_to_completion(sched, FakeRunner(sched.num_kv_blocks, sched.block_size, sched.kv.pool, tokens_per_step=k))


@pytest.mark.parametrize("k", [2, 3])
def test_several_tokens_per_step_give_the_reference_and_stop_at_max_tokens_mid_list(k):
    sched = make_scheduler(num_blocks=32, block_size=4)
    for rid, prompt in PROMPTS.items():
        sched.add_request(make_request(rid, prompt, max_tokens=7))
    res = _run(sched, k)
    assert res.tokens == {rid: reference_generate(p, 7) for rid, p in PROMPTS.items()}
    assert all(f == ("length", None) for f in res.finish.values())
    # Each step computed the tokens the one before returned, then sampled again.
    assert any(s.num_tokens == k for so in res.steps for s in so.sequences if s.sample)


def test_a_stop_token_in_the_middle_of_a_list_ends_the_request_there():
    prompt = [5, 6, 7]
    ref = reference_generate(prompt, 12)
    at = next(i for i in range(3, 12) if ref[i] not in ref[:i])      # first occurrence, mid-list
    sched = make_scheduler()
    sched.add_request(make_request("eos", prompt, max_tokens=12, eos=(ref[at],)))
    sched.add_request(make_request("stop", prompt, max_tokens=12, stop_token_ids=[ref[at]]))
    res = _run(sched, 3)
    assert res.tokens == {"eos": ref[:at + 1], "stop": ref[:at + 1]}
    assert res.finish == {"eos": ("stop", None), "stop": ("stop", ref[at])}


def test_the_length_cap_in_the_middle_of_a_list():
    sched = make_scheduler(max_model_len=10)
    sched.add_request(make_request("a", [1, 2, 3, 4], max_tokens=50))
    res = _run(sched, 4)
    assert res.tokens["a"] == reference_generate([1, 2, 3, 4], 6) and res.finish["a"] == ("length", None)


def test_logprobs_are_cut_with_the_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=8, stop_token_ids=[42], logprobs=1))
    so = sched.schedule()
    lps = [PositionLogprobs([t], [-0.5 * t], [1]) for t in (7, 42, 9)]
    out = sched.update_from_output(so, ModelRunnerOutput({"a": [7, 42, 9]}, {"a": lps}))
    assert [(o.new_token_ids, o.new_logprobs, o.finish_reason, o.stop_token_id) for o in out] == \
        [([7, 42], lps[:2], "stop", 42)]
    sched.schedule()                         # hands the finished id to the runner
    assert_pool_idle(sched)


class _DropsOnce(FakeRunner):
    """Returns no token for `rid` at its second sampling step (nothing sampled for it)."""

    def __init__(self, *args, rid: str) -> None:
        super().__init__(*args)
        self.rid, self.seen = rid, 0

    def execute(self, so):
        out = super().execute(so)
        if self.rid in out.sampled_token_ids:
            self.seen += 1
            if self.seen == 2:
                out.sampled_token_ids[self.rid] = []
        return out


def test_a_step_with_no_token_for_a_request_samples_it_again():
    sched = make_scheduler(block_size=4)
    for rid, prompt in PROMPTS.items():
        sched.add_request(make_request(rid, prompt, max_tokens=6))
    res = run_to_completion(sched, _DropsOnce(sched.num_kv_blocks, sched.block_size, sched.kv.pool, rid="b"))
    assert res.tokens == {rid: reference_generate(p, 6) for rid, p in PROMPTS.items()}


def test_preemption_with_several_tokens_per_step_stays_token_identical():
    sched = make_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=16)
    for rid, prompt in PROMPTS.items():
        sched.add_request(make_request(rid, prompt, max_tokens=10))
    res = _run(sched, 3)
    assert res.tokens == {rid: reference_generate(p, 10) for rid, p in PROMPTS.items()}
    assert sched.num_preemptions > 0
