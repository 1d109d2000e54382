"""The CPU runner's native decode step (executor/cpu_decode.py) in the engine, on the bundled Q4_1
GGUF: chosen at start-up for `--dtype auto`, it runs every decode-only step (prefill and mixed
steps keep the per-op forward), and its greedy tokens are the per-op path's (`enforce_eager`),
one sequence at a time and several together with different lengths."""

from __future__ import annotations

import pytest

from tokenforge import LLM, SamplingParams
from tokenforge.executor.cpu_decode import CpuDecodeRunner

PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5,", "Once upon a time, in a small village by the sea,"]


def _runner(llm: LLM):
    return llm.engine.executor.runner


def _top2_gap(logprobs: dict) -> float:
    top = sorted((v.logprob for v in logprobs.values()), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def _same_until_a_near_tie(tokens: list[int], want: list[int], gaps: list[float]) -> None:
    """Equal tokens, or equal up to a step where the per-op path's top two were within 0.15 nats:
    the two paths differ in attention summation order (~1e-7), which can move an 8-bit activation
    code and so a near tie (measured: 0.08 nats on the third prompt after the prefill moved to SDPA's
    fused kernel); a divergence at a clear choice fails."""
    diff = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
    assert diff is None or gaps[diff] < 0.15, f"diverged at step {diff}, a clear choice (gap {gaps[diff]:.3f})"


@pytest.mark.slow
def test_native_decode_steps_give_the_per_op_tokens(monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    eager = LLM(max_model_len=256, enforce_eager=True)
    assert _runner(eager).graphs is None
    outs = eager.generate(PROMPTS, params, use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in outs]
    gaps = [[_top2_gap(lp) for lp in o.outputs[0].logprobs] for o in outs]
    eager.shutdown()
    calls = []
    run = CpuDecodeRunner.run
    monkeypatch.setattr(CpuDecodeRunner, "run", lambda self, inputs: calls.append(inputs.num_seqs) or run(self, inputs))
    llm = LLM(max_model_len=256)
    assert isinstance(_runner(llm).graphs, CpuDecodeRunner)
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    alone = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    for got in (together, alone):
        for tokens, want, gap in zip(got, expected, gaps):
            _same_until_a_near_tie(tokens, want, gap)
    assert 3 in calls and calls.count(1) >= 3 * (12 - 2)     # the batched steps and the one-row steps ran natively
    stats = llm.get_stats()                                  # the graph counters read the native step too
    assert (stats.cuda_graphs_pending, stats.eager_decode_steps) == (0, 0)
    assert llm.engine.idle_work() is False                   # nothing deferred to capture when idle
    llm.shutdown()


def test_the_float32_path_keeps_the_per_op_forward():
    llm = LLM("tiny-llama", load_format="dummy", device="cpu", max_model_len=128)
    assert _runner(llm).graphs is None
    llm.shutdown()


@pytest.mark.slow
def test_speculative_verify_steps_run_natively_and_stay_exact(monkeypatch):
    """A verify step (the last token and its drafts) runs the native step as decode rows; every
    row's KV is stored before any row attends, so greedy output with n-gram drafts equals without."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["Repeat exactly: red, green, blue, red, green, blue, red, green, blue, red,",
               "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,"] + PROMPTS[:1]
    base = LLM(max_model_len=256)
    expected = [base.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    base.shutdown()
    verify_rows = []
    run = CpuDecodeRunner.run

    def spy(self, inputs):
        if not inputs.is_decode_only:
            verify_rows.append(inputs.num_tokens)
        return run(self, inputs)
    monkeypatch.setattr(CpuDecodeRunner, "run", spy)
    llm = LLM(max_model_len=256, speculative_method="ngram", num_speculative_tokens=4)
    llm.engine.scheduler.drafts.adaptive = False
    got = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    stats = llm.engine.scheduler.drafts.stats()
    llm.shutdown()
    assert got == expected
    assert verify_rows and max(verify_rows) == 5 and stats["num_accepted_tokens"] > 10, (verify_rows, stats)
