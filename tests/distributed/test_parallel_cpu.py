"""Tensor and pipeline parallelism on the CPU: gloo, one process per rank, the engine core on rank 0.

Greedy tokens of every layout equal TP=1's on the same weights (the widened bundled model, fp32),
with one step passing the stages at a time and with several in flight (--pipeline-steps);
bad layouts fail before any process starts; a rank that fails to start takes the others down.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
import uuid

import pytest

from tests.distributed.conftest import ENGINE, PROMPTS, assert_same_outputs, processes_with_env, run_mixed
from tokenforge import LLM

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("layout,in_flight", [
    # TP=2 alone: test_a_start_that_fails_past_the_executor_leaves_nothing_joined's second engine
    ({"pipeline_parallel_size": 2}, 2),                        # pipeline_steps defaults to PP
    ({"pipeline_parallel_size": 2, "pipeline_steps": 1}, 0),   # one step passes the stages at a time
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 2),
], ids=["pp2", "pp2-steps1", "tp2xpp2"])
def test_outputs_match_tp1(widened_model, tp1_outputs, layout, in_flight):
    """Greedy tokens, a seeded sample (rank 0 samples and broadcasts) and logprobs, against TP=1.
    With pipelined steps the 7 requests split into two steps in flight at once."""
    with LLM(widened_model, **ENGINE, **layout) as llm:
        assert_same_outputs(run_mixed(llm), tp1_outputs)
        stats = llm.get_stats()
        assert llm.engine.max_steps_in_flight == in_flight
    assert stats.num_free_blocks == stats.num_kv_blocks      # every block back after the batch
    assert not multiprocessing.active_children()              # the workers are gone


def test_a_start_that_fails_past_the_executor_leaves_nothing_joined(widened_model, tp1_outputs, monkeypatch):
    """A TP engine whose start fails after its workers joined (here the draft planner's set-up)
    takes them and the process group down with it, so the next TP engine in this process starts
    and serves (it used to wait forever in its first group, on the stale one). That engine is
    also test_outputs_match_tp1's TP=2 layout (one TP=2 start fewer): its outputs equal TP=1's,
    one step at a time, every block back, its workers gone."""
    import torch.distributed as dist

    from tokenforge.engine import engine_core

    def fail(*args, **kwargs):
        raise RuntimeError("injected: the start fails after the executor exists")

    monkeypatch.setattr(engine_core, "make_draft_planner", fail)
    with pytest.raises(RuntimeError, match="injected"):
        LLM(widened_model, **ENGINE, tensor_parallel_size=2)
    assert not dist.is_initialized()
    assert not multiprocessing.active_children()
    monkeypatch.undo()
    with LLM(widened_model, **ENGINE, tensor_parallel_size=2) as llm:
        assert_same_outputs(run_mixed(llm), tp1_outputs)
        stats = llm.get_stats()
        assert llm.engine.max_steps_in_flight == 0
    assert stats.num_free_blocks == stats.num_kv_blocks      # every block back after the batch
    assert not multiprocessing.active_children()              # the workers are gone


def test_pipelined_steps_with_preemption_and_shared_prefixes(widened_model):
    """Three steps in flight on two stages, more requests than a step takes, prompts sharing a
    prefix block, two grammar-constrained requests (masks filled at launch, used at collect), a KV
    cache small enough to preempt: greedy tokens equal TP=1's, and every block comes back."""
    from tokenforge import SamplingParams, StructuredOutputsParams

    shared = "In a quiet village by the sea, the old lighthouse keeper told the children a story about"
    prompts = [f"{shared} {topic}" for topic in ("a whale", "the storm of 1902", "his first ship")]
    prompts += [*PROMPTS, "Water boils at", "import numpy as np\n", "Roses are red,"]
    params = [SamplingParams(max_tokens=3 + 4 * (i % 4), temperature=0) for i in range(len(prompts))]
    prompts += ["The year the war ended:", "My favourite colour is"]
    params += [SamplingParams(max_tokens=8, temperature=0, structured_outputs=grammar)
               for grammar in (StructuredOutputsParams(regex="[0-9]{4}"),
                               StructuredOutputsParams(choice=["red", "green", "blue"]))]
    small = {**ENGINE, "num_kv_blocks": 9}
    with LLM(widened_model, **small) as llm:
        expected = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(widened_model, **small, pipeline_parallel_size=2, pipeline_steps=3) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        got, texts = [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].text for o in outs]
        stats, most = llm.get_stats(), llm.engine.max_steps_in_flight
    assert got == expected
    assert len(texts[-2]) == 4 and texts[-2].isdigit() and texts[-1] in ("red", "green", "blue")
    assert most == 3 and stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.num_free_blocks == stats.num_kv_blocks


@pytest.mark.parametrize("kwargs,message", [
    ({"tensor_parallel_size": 2}, "does not divide the model's 9 attention heads"),
    ({"pipeline_parallel_size": 31}, "larger than the model's 30 layers"),
])
def test_bad_layouts_fail_before_any_process_starts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(**{**ENGINE, **kwargs})
    assert not multiprocessing.active_children()


def test_more_gpus_than_visible_is_refused(monkeypatch):
    import torch

    from tokenforge.config import EngineConfig
    from tokenforge.executor.parallel_check import check_parallel_layout
    from tokenforge.model.loader import read_arch_config

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config = EngineConfig.from_kwargs(tensor_parallel_size=3, device="cpu")
    with pytest.raises(ValueError, match="3 x 1 needs 3 GPUs on this host, but 2 are visible"):
        check_parallel_layout(config, read_arch_config(None), "cuda")


def test_a_rank_that_fails_to_start_takes_the_others_down():
    marker = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": REPO, "TOKENFORGE_TEST_MARKER": marker, "TOKENFORGE_FAULT_RANK": "start:2"}
    code = ("from tokenforge import LLM\nif __name__ == '__main__':\n"
            "    LLM(device='cpu', num_threads=1, pipeline_parallel_size=3)\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "injected fault: rank 2" in proc.stderr
    assert "exited with code 1" in proc.stderr
    deadline = time.monotonic() + 30          # a bound on a hang: busy cores slow the ranks' exits
    while processes_with_env(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with_env(marker) == [], "orphaned worker processes"
    assert time.monotonic() - start < 120


def test_speculative_decoding_under_tensor_parallelism(widened_model, tp1_outputs):
    """n-gram drafts verified with the LM head split over two ranks (the followers join the plain,
    prompt and verify rows' collectives in rank 0's order): the mixed batch's outputs equal TP=1's
    without speculation (the seeded sample, with logprobs, is not drafted)."""
    with LLM(widened_model, **ENGINE, tensor_parallel_size=2, speculative_method="ngram",
             num_speculative_tokens=3) as llm:
        assert_same_outputs(run_mixed(llm), tp1_outputs)
        assert llm.engine.scheduler.drafts.num_verify_steps > 0
        stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_kv_blocks
