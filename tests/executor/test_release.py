"""Shutdown frees an engine's memory deterministically: with the garbage collector off, the
weights and KV cache are gone after `shutdown()`, and the resolved context length sizes the
runner's buffers (issue 26: a default-configured engine sized its CUDA-graph block tables from
the scheduler's unresolved 2048)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tokenforge import LLM, SamplingParams


def _runner(llm):
    return llm.engine.executor.runner


def test_shutdown_frees_weights_and_kv_without_gc():
    llm = LLM(num_kv_blocks=64, max_model_len=512)
    llm.generate(["The capital of France is"], SamplingParams(max_tokens=4), use_tqdm=False)
    runner = _runner(llm)
    weight = weakref.ref(next(runner.model.parameters()))
    kv = weakref.ref(runner.kv_caches[0])
    gc.disable()
    try:
        llm.shutdown()
        assert weight() is None, "a weight outlived shutdown()"
        assert kv() is None, "the KV cache outlived shutdown()"
    finally:
        gc.enable()


def test_runner_buffers_use_the_resolved_context_length():
    llm = LLM(num_kv_blocks=64)          # no max_model_len: the model's own limit
    try:
        resolved = llm.engine.max_model_len
        assert resolved == llm.engine.executor.arch.max_position_embeddings
        assert resolved > 2048
        assert _runner(llm).config.scheduler.max_model_len == resolved
    finally:
        llm.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_three_engines_in_one_process_give_their_memory_back():
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for _ in range(3):
        llm = LLM("llama-3.2-1b", load_format="dummy", gpu_memory_utilization=0.5)
        llm.generate(["Hello"], SamplingParams(max_tokens=8), use_tqdm=False)
        llm.shutdown()
        del llm
        assert torch.cuda.memory_allocated() - base < 200 * 2**20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_long_prompts_on_a_default_configured_engine_match_eager():
    prompts = [list(range(100, 100 + n)) for n in (3000, 8000, 30000)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        llm = LLM("llama-3.2-1b", load_format="dummy", enforce_eager=eager)   # no --max-model-len
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        llm.shutdown()
    assert outs[False] == outs[True]
