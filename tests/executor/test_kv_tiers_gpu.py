"""The KV tiers on CUDA: side-stream block copies and an engine whose evicted prefix comes back
from pinned host memory, token-identical to a device prefix-cache hit."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_block_mover_round_trip_on_the_side_stream():
    from tokenforge.executor.tiers.blocks import BlockMover

    kv = [torch.randn(2, 16, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    original = [t.clone() for t in kv]
    mover = BlockMover(kv, pin=True)
    host, ready = mover.gather_to_host([1, 3, 7])
    for t in kv:          # the main stream overwrites the blocks right after: the gather came first
        t[:, [1, 3, 7]] = 0
    ready.synchronize()
    assert host.is_pinned() and host.shape == (3, 4, 2, 16, 8, 128)
    mover.scatter_from_host(list(host), [10, 11, 12], mover.mark_main_stream())
    for t, o in zip(kv, original):
        assert torch.equal(t[:, [10, 11, 12]], o[:, [1, 3, 7]])


@needs_cuda
def test_engine_restores_an_evicted_prefix_from_the_cpu_tier():
    from tokenforge import LLM, SamplingParams

    llm = LLM("llama-3.2-1b", load_format="dummy", dtype="bfloat16", num_kv_blocks=96, max_model_len=2048,
              kv_offload_cpu_gb=1.0)
    rng = random.Random(0)
    prefix = [rng.randrange(100, 120000) for _ in range(800)]
    target = {"prompt_token_ids": prefix + [11, 12, 13]}
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    llm.generate([target], params, use_tqdm=False)
    device_hit = llm.generate([target], params, use_tqdm=False)[0]
    assert device_hit.num_cached_tokens == 800
    others = [{"prompt_token_ids": [rng.randrange(100, 120000) for _ in range(700)]} for _ in range(3)]
    llm.generate(others, params, use_tqdm=False)          # evicts the prefix from the 96 device blocks
    restored = llm.generate([target], params, use_tqdm=False)[0]
    stats = llm.get_stats().kv_tiers
    assert stats.hits.get("cpu", 0) >= 25 and stats.restored_tokens >= 400
    assert restored.num_cached_tokens == 800
    assert restored.outputs[0].token_ids == device_hit.outputs[0].token_ids
    assert llm.get_stats().num_free_blocks == 96


@needs_cuda
def test_batched_store_copies_round_trip_on_the_save_and_load_streams():
    from tokenforge.executor.tiers.blocks import BlockMover

    kv = [torch.randn(2, 32, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    original = [t.clone() for t in kv]
    mover = BlockMover(kv, pin=True)
    store = torch.zeros((16, *mover.block_shape), dtype=mover.dtype, pin_memory=True)
    blocks, slots = [1, 3, 7, 9, 11], [6, 5, 4, 12, 0]          # descending run, single slots
    mover.save_to_store(blocks, store, slots, reused_slots=False)
    for t in kv:          # the main stream overwrites the blocks right after: the gather came first
        t[:, blocks] = 0
    handle = mover.load_from_store(store, slots, [20, 21, 22, 23, 24], mover.mark_main_stream())
    handle.synchronize()
    assert handle.query() and handle.copy_seconds() > 0
    for t, o in zip(kv, original):
        assert torch.equal(t[:, [20, 21, 22, 23, 24]], o[:, blocks])
