"""Steps where the adaptive rule drafts nothing still catch the EAGLE head up on the target's
features (executor/spec/eagle.py): with the head's graphs that is one replay of the catch-up graph
alone (d = 0, eagle_graphs.py), and the drafts of the steps after it are the ones the eager
catch-up gives, token for token. (Skipping the catch-up there would leave the head's KV of those
positions stale, and its drafts would differ.)"""

from __future__ import annotations

import itertools

import pytest

from tests.engine.test_speculative_eagle import TINY, _engine, _greedy, tiny_llama  # noqa: F401 - a fixture
from tests.executor.spec.eagle_heads import write_eagle1


@pytest.mark.parametrize("max_num_seqs", [4, 1], ids=["batch", "alone"])
def test_steps_that_draft_nothing_keep_the_head_caught_up(tiny_llama, tmp_path, max_num_seqs):  # noqa: F811
    """`alone` (one request at a time): the drafter keeps the idle steps' catch-up rows and runs them
    as one pass before the next drafting step (eagle_defer.py), eager (the CPU's default) or
    graphed; its drafts are still those of a catch-up run every step."""
    prompts = [{"prompt_token_ids": p} for p in ([1, 5, 9, 200, 3], list(range(10, 90)))]
    head = write_eagle1(tmp_path / "head", TINY)
    runs, flushed = [], {}
    for variant in ("every step", "deferred", "graphed"):
        graphed = variant == "graphed"
        llm = _engine(tiny_llama, speculative_method="eagle", speculative_model=head, num_speculative_tokens=4,
                      max_num_seqs=max_num_seqs)
        steps = itertools.count()
        llm.engine.scheduler.drafts.choose_k = lambda batch: 4 if next(steps) % 3 == 2 else 0   # two idle, one drafts
        drafter = llm.engine.executor.runner.drafter
        depths = []
        if variant == "every step":
            drafter.deferred = None
        if graphed:
            drafter.enable_graphs(capture=False)
            replay = drafter.graphs.run
            drafter.graphs.run = lambda *a: depths.append(a[-1]) or replay(*a)
        inputs, before = [], drafter.before_forward
        drafter.before_forward = lambda step: (before(step), inputs.append(step.inputs.input_ids.tolist()))
        ids = _greedy(llm, prompts, 40)
        flushes = drafter.deferred.flushes if drafter.deferred is not None else None
        stats = llm.engine.scheduler.drafts.stats()
        kv = llm.get_stats()
        llm.shutdown()
        assert kv.num_free_blocks == kv.num_kv_blocks
        stats.pop("measured_cost_scale")          # wall-clock timing, not the drafts
        runs.append((ids, inputs, stats))
        flushed[variant] = flushes
    assert runs[1] == runs[0] and runs[2] == runs[0]
    assert runs[0][2]["num_drafts"] >= 10, runs[0][2]
    if max_num_seqs == 1:                  # idle steps kept their rows: no catch-up replay, a flush before each draft
        assert flushed["deferred"] >= 10 and flushed["graphed"] >= 10, flushed
        assert depths.count(0) <= 2 and any(d > 0 for d in depths), depths
    else:
        assert flushed["deferred"] == flushed["graphed"] == 0, flushed
        assert depths.count(0) >= 15 and any(d > 0 for d in depths), depths
