"""Speculative decoding on the GPU (skipped without CUDA; run on the device machine): the verify
steps replay the CUDA graphs' verify buckets, greedy output equals greedy without speculation on
the bundled model (float32), sampled requests with drafts run, and every KV block comes back."""

from __future__ import annotations

import gc

import pytest
import torch

from tokenforge import LLM, SamplingParams
from tokenforge.executor import cond_graph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [
    "Repeat the list exactly: apples, pears, plums, cherries, apples, pears, plums, cherries, apples,",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "The capital of France is",
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,",
    ("The quick brown fox jumps over the lazy dog. " * 6).strip(),
]


def _generate(**kw):
    llm = LLM(max_model_len=1024, kv_cache_memory="1GiB", dtype="float32", **kw)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    ids = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    return llm, ids


def _free(llm) -> None:
    llm.engine.shutdown()
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_graphed_verify_is_exact_and_frees_blocks(max_num_seqs, monkeypatch):
    monkeypatch.setenv("TOKENFORGE_SPEC_BURST", "0")      # every verify a step of its own (bursts: below)
    base, base_ids = _generate(max_num_seqs=max_num_seqs)
    _free(base)
    llm, ids = _generate(max_num_seqs=max_num_seqs, speculative_method="ngram", num_speculative_tokens=4)
    try:
        graphs = llm.engine.executor.runner.graphs
        assert graphs is not None and graphs.verify_replays > 0, "verify steps did not replay a CUDA graph"
        assert 5 in graphs.sizes
        stats = llm.engine.scheduler.drafts.stats()
        assert stats["num_accepted_tokens"] > 0
        for i, (a, b) in enumerate(zip(base_ids, ids)):
            assert a == b, f"prompt {i}: {a} != {b}"
        kv = llm.get_stats()
        assert kv.num_free_blocks == kv.num_kv_blocks, "KV blocks leaked"
        # sampled rows with drafts: the rejection rule on the device, the lengths as asked
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
        kv = llm.get_stats()
        assert kv.num_free_blocks == kv.num_kv_blocks, "KV blocks leaked after sampled verification"
    finally:
        _free(llm)


@pytest.mark.parametrize("burst_if", ["0", "1"])
def test_bursts_replay_their_graph_and_stay_exact(burst_if, monkeypatch):
    """Batch 1 with the n-gram method runs in bursts (on by default on a GPU): greedy output equal to
    greedy without speculation, a stop inside a burst where it is without, every block back; with
    TOKENFORGE_SPEC_BURST_IF=1 the iterations past the stop do not run."""
    monkeypatch.setenv("TOKENFORGE_SPEC_BURST_IF", burst_if)
    base, base_ids = _generate(max_num_seqs=1)
    short = SamplingParams(temperature=0.0, max_tokens=13)
    base_short = [o.outputs[0].token_ids for o in base.generate(PROMPTS, short, use_tqdm=False)]
    _free(base)
    llm, ids = _generate(max_num_seqs=1, speculative_method="ngram", num_speculative_tokens=4)
    try:
        burst = llm.engine.executor.runner.burst
        assert burst.graph is not None and burst.launches > 0, "no burst replayed its CUDA graph"
        # torch's if-node capture: the burst's iterations in one graph, skipped past a stop
        assert burst.conditional == (burst_if == "1" and cond_graph.builder() is not None)
        assert burst.max_steps == (32 if burst.conditional else 8)    # the bundled 135M model: the longest
        for i, (a, b) in enumerate(zip(base_ids, ids)):
            assert a == b, f"prompt {i}: {a} != {b}"
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, short, use_tqdm=False)] == base_short
        # a stop id 20 tokens in: the output ends there, and the burst ran no iteration after it
        stop = next(t for i, t in enumerate(base_ids[1]) if i >= 20 and t not in base_ids[1][:i])
        params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, stop_token_ids=[stop])
        got = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == base_ids[1][:base_ids[1].index(stop) + 1]
        ran, counts = int(burst.state[1]), burst.counts.tolist()
        if burst.conditional:
            assert ran < burst.max_steps and counts[1 + 2 * ran:] == [0] * (len(counts) - 1 - 2 * ran)
        stats = llm.engine.scheduler.drafts.stats()
        assert 0 < stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
        kv = llm.get_stats()
        assert kv.num_free_blocks == kv.num_kv_blocks, "KV blocks leaked"
    finally:
        _free(llm)


def test_bursts_on_a_dummy_model_equal_the_stepwise_verify(monkeypatch):
    """The same on tiny-llama's shape with dummy float32 weights (no checkpoint needed): bursts,
    per-step verify and no speculation give the same greedy tokens; long repetitive prompts so the
    lookup finds drafts."""
    prompts = [{"prompt_token_ids": ([5, 9, 13, 17, 21, 25] * 20)[:100 + 7 * i]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=61, ignore_eos=True)

    burst_if = None

    def run(burst: str | None, **kw):
        if burst is not None:
            monkeypatch.setenv("TOKENFORGE_SPEC_BURST", burst)
        llm = LLM("tiny-llama", load_format="dummy", dtype="float32", max_model_len=512, max_num_seqs=1,
                  kv_cache_memory="256MiB", **kw)
        ids = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runner_burst = llm.engine.executor.runner.burst
        launches = runner_burst.launches if kw else 0
        if launches:       # if-nodes where torch has them, when asked for
            want = cond_graph.builder() is not None and burst_if == "1"
            assert runner_burst.conditional == want and runner_burst.max_steps == (32 if want else 8)
        kv = llm.get_stats()
        assert kv.num_free_blocks == kv.num_kv_blocks, "KV blocks leaked"
        _free(llm)
        return ids, launches

    spec = {"speculative_method": "ngram", "num_speculative_tokens": 4}
    base, _ = run(None)
    stepwise, none_launched = run("0", **spec)
    monkeypatch.delenv("TOKENFORGE_SPEC_BURST")
    bursts, launched = run(None, **spec)
    monkeypatch.setenv("TOKENFORGE_SPEC_BURST_IF", "1")   # the iterations as conditional nodes
    burst_if = "1"
    replayed, replay_launched = run(None, **spec)
    assert none_launched == 0 and launched > 0 and replay_launched > 0
    assert stepwise == base and bursts == base and replayed == base


def test_draft_model_on_the_gpu_is_exact():
    """The bundled model drafting for itself (eager draft forwards, graphed verify): greedy output
    unchanged, nearly every draft accepted, blocks back."""
    from tokenforge.source import find_bundled_gguf

    base, base_ids = _generate(max_num_seqs=4)
    _free(base)
    llm, ids = _generate(max_num_seqs=4, speculative_method="draft", speculative_model=str(find_bundled_gguf()),
                         num_speculative_tokens=3)
    try:
        assert ids == base_ids
        assert llm.engine.scheduler.drafts.stats()["acceptance_rate"] > 0.8
        assert llm.engine.executor.runner.graphs.verify_replays > 0
        kv = llm.get_stats()
        assert kv.num_free_blocks == kv.num_kv_blocks, "KV blocks leaked"
    finally:
        _free(llm)


@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_eagle_draft_graphs_replay_and_stay_exact(tmp_path, max_num_seqs):
    """The EAGLE head's draft replays its CUDA graphs (eagle_graphs.py) and greedy output still
    equals greedy without speculation; the graphed drafts equal the eager head's (same counts)."""
    from tests.executor.spec.eagle_heads import write_eagle1

    head = write_eagle1(tmp_path / "head")
    base, base_ids = _generate(max_num_seqs=max_num_seqs)
    _free(base)
    runs = []
    for graphed in (True, False):
        llm, ids = None, None
        llm = LLM(max_model_len=1024, kv_cache_memory="1GiB", dtype="float32", max_num_seqs=max_num_seqs,
                  speculative_method="eagle", speculative_model=head, num_speculative_tokens=4)
        try:
            drafter = llm.engine.executor.runner.drafter
            assert drafter.graphs is not None, "the draft graphs were not captured"
            if not graphed:
                drafter.graphs.release()
                drafter.graphs = None
            llm.engine.scheduler.drafts.adaptive = False
            params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
            ids = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            if graphed:
                assert drafter.graphs.replays > 10, drafter.graphs.replays
            runs.append((ids, llm.engine.scheduler.drafts.stats()))
            kv = llm.get_stats()
            assert kv.num_free_blocks == kv.num_kv_blocks, "KV blocks leaked"
        finally:
            _free(llm)
    assert runs[0][0] == base_ids
    assert runs[0] == runs[1]
