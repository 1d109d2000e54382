"""GPU: CUDA graphs captured in two stages (executor/graph_stages.py). An engine that defers the
large buckets serves a batch of 12 eagerly (bucket 16 not captured yet, counted), captures the
rest through `idle_work` (what the core process's idle loop calls), then serves the same batch
from graphs: the same greedy tokens, and no kernel compiled on a request's path either way."""

from __future__ import annotations

import random

import pytest
import torch

from tokenforge import LLM, SamplingParams
from tokenforge.engine import llm as llm_module
from tokenforge.engine.engine_core import EngineCore
from tokenforge.executor.compile_watch import WATCH

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_deferred_buckets_run_eagerly_then_from_graphs_with_the_same_tokens(monkeypatch):
    monkeypatch.setattr(llm_module, "EngineCore", lambda config, tokenizer, defer_graphs: EngineCore(
        config, tokenizer, defer_graphs=True))
    llm = LLM("tiny-llama", load_format="dummy", dtype="float32", max_model_len=1024, kv_cache_memory="2GiB",
              max_num_seqs=64, enable_prefix_caching=False)   # the second run recomputes, as the first
    try:
        stages = llm.engine.executor.runner.graphs.stages
        later = [16, 32, 48, 64, 128, 192, 256, 384, 512]     # the decode buckets, then short prompts' (PrefillRows)
        assert sorted(stages.captured) == [1, 2, 4, 8] and stages.pending == later
        rng = random.Random(3)
        prompts = [{"prompt_token_ids": [rng.randrange(500) for _ in range(rng.randint(20, 200))]} for _ in range(12)]
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.get_stats()
        assert stats.eager_decode_steps >= 20 and stats.cuda_graphs_pending == len(later)
        while llm.engine.idle_work():
            pass
        assert llm.get_stats().cuda_graphs_pending == 0 and sorted(stages.captured) == [1, 2, 4, 8] + later
        graphs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.get_stats().eager_decode_steps == stats.eager_decode_steps     # every decode replayed a graph
        assert graphs == eager
        assert WATCH.after_ready == [], WATCH.after_ready
    finally:
        llm.shutdown()
