"""The engine with async scheduling (step N+1 queued before step N is read back) on the CPU.

CUDA turns it on by default; here it is forced on, so the placeholder plumbing of the real model
runner (sampled ids fed from the previous step's tensor) is checked against the synchronous
engine, token for token, under preemption, chunked prefill, stops, n > 1 and seeded sampling.
"""

import pytest

from tokenforge import LLM, SamplingParams

# Every engine here runs float32, the reference path: GGUF-native 8-bit activations turn float
# rounding differences between batch shapes into different tokens (tests/model/test_gguf_native.py
# covers that path); these tests are about the scheduling.

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
    "Q: Why is the sky blue?\nA:",
    "SELECT name, COUNT(*) FROM users GROUP BY",
]


def _params():
    return [
        SamplingParams(max_tokens=12, temperature=0.0),
        SamplingParams(max_tokens=7, temperature=0.0, stop=[","]),
        SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7, n=2),
        SamplingParams(max_tokens=5, temperature=0.0, logprobs=2),
        SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=3),
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
    ]


def _run(**kwargs):
    llm = LLM(max_model_len=512, dtype="float32", **kwargs)
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_kv_blocks, "KV blocks leaked"
    assert not llm.engine.has_unfinished_requests()
    return llm, [[(c.token_ids, c.finish_reason, c.text) for c in o.outputs] for o in outs], outs


@pytest.fixture(scope="module")
def sync_run():
    """The synchronous engine and its outputs: the reference of every async run here."""
    llm, outputs, _ = _run(async_scheduling=False)
    yield llm, outputs
    llm.shutdown()


@pytest.fixture(scope="module")
def sync_outputs(sync_run):
    return sync_run[1]


@pytest.mark.parametrize("kwargs", [
    dict(),                                                   # plenty of room
    dict(num_kv_blocks=8, block_size=8),                      # forces preemption
    dict(max_num_batched_tokens=16),                          # chunked prefill
], ids=["roomy", "preempting", "chunked"])
def test_async_engine_matches_sync_engine(sync_outputs, kwargs):
    llm, outputs, outs = _run(async_scheduling=True, **kwargs)
    assert llm.engine.async_scheduling
    assert outputs == sync_outputs
    if "num_kv_blocks" in kwargs:
        assert llm.get_stats().num_preemptions > 0
    logprobs = outs[3].outputs[0].logprobs
    assert len(logprobs) == len(outs[3].outputs[0].token_ids) and all(len(p) >= 2 for p in logprobs)


def test_async_engine_falls_back_to_sync_for_penalties_and_stays_correct(sync_run):
    sync_llm, sync_outputs = sync_run
    llm = LLM(max_model_len=512, dtype="float32", async_scheduling=True)
    mixed = _params() + [SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3)]
    outs = llm.generate(PROMPTS + ["The capital of France is"], mixed, use_tqdm=False)
    got = [[(c.token_ids, c.finish_reason, c.text) for c in o.outputs] for o in outs[:-1]]
    assert got == sync_outputs
    ref = sync_llm.generate("The capital of France is", mixed[-1], use_tqdm=False)     # its prompt fills no block
    assert outs[-1].outputs[0].token_ids == ref[0].outputs[0].token_ids
    # a second call reuses the engine: nothing was left in flight
    again = llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert [[(c.token_ids, c.finish_reason, c.text) for c in o.outputs] for o in again] == sync_outputs


def test_a_prefix_computed_in_the_same_step_is_shared_and_correct(sync_run):
    """Blocks are registered when scheduled: a request admitted in the same step as the one that
    computes its prefix shares those blocks (the KV store of a layer precedes its attention). The
    engine is the module's synchronous one (prefix caching on, as by default; it never saw these
    prompts)."""
    prompt = "The history of the printing press begins in the fifteenth century. " * 8
    params = SamplingParams(max_tokens=6, temperature=0.0)
    reference = LLM(max_model_len=512, dtype="float32", enable_prefix_caching=False)     # each prompt alone
    alone, longer = (reference.generate(p, params, use_tqdm=False)[0] for p in (prompt, prompt + " And"))
    reference.shutdown()
    llm = sync_run[0]
    assert llm.engine.config.cache.enable_prefix_caching
    first, second = llm.generate([prompt, prompt + " And"], params, use_tqdm=False)
    assert second.num_cached_tokens >= 64 and first.num_cached_tokens == 0
    assert first.outputs[0].token_ids == alone.outputs[0].token_ids
    assert second.outputs[0].token_ids == longer.outputs[0].token_ids


def test_an_interrupted_async_generate_leaves_the_engine_clean(monkeypatch):
    from tokenforge.engine import output_processor

    llm = LLM("tiny-llama", load_format="dummy", device="cpu", max_model_len=256, async_scheduling=True)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    real, calls = output_processor.OutputProcessor.process_outputs, []

    def flaky(self, outs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(self, outs)

    monkeypatch.setattr(output_processor.OutputProcessor, "process_outputs", flaky)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(output_processor.OutputProcessor, "process_outputs", real)
    stats = llm.get_stats()
    assert not llm.engine.has_unfinished_requests()
    assert stats.num_free_blocks == stats.num_kv_blocks and stats.num_running == stats.num_waiting == 0
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
