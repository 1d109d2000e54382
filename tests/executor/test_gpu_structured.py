"""Structured outputs and min_tokens on the GPU path (async scheduling on), on dummy weights of
the Llama-3.2-1B shape (the GPU image has no bundled model): constrained requests keep async
scheduling (the sampling of a step scheduled ahead waits for its masks, the forward does not),
their outputs follow the grammar, and free rows in a mixed batch produce the tokens they produce
in an all-free batch of the same shape (ignore_eos keeps every row running)."""

from __future__ import annotations

import json

import pytest
import torch

from tokenforge import LLM, SamplingParams, StructuredOutputsParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "tags": {"type": "array", "maxItems": 3,
                                                    "items": {"enum": ["a", "b", "c"]}}},
          "required": ["name", "tags"], "additionalProperties": False}
PROMPTS = [{"prompt_token_ids": [100 + 7 * i + j for j in range(12)]} for i in range(8)]


@pytest.fixture(scope="module")
def llm():
    return LLM("llama-3.2-1b", load_format="dummy", dtype="float32", max_num_seqs=16, num_kv_blocks=256,
               max_model_len=512)


def test_mixed_batch_on_gpu(llm):
    assert llm.engine.async_scheduling
    free = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    constrained = free.clone(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    alone = llm.generate(PROMPTS, free, use_tqdm=False)
    real_sample, late = llm.engine.executor.sample, []

    def spy(handle, sched):
        late.append(bool(sched.grammar_rows))
        real_sample(handle, sched)

    llm.engine.executor.sample = spy
    try:
        mixed = llm.generate(PROMPTS, [constrained if i % 2 else free for i in range(8)], use_tqdm=False)
    finally:
        del llm.engine.executor.sample
    assert sum(late) >= 40 and all(late), "constrained steps were not scheduled ahead"
    for i, (a, m) in enumerate(zip(alone, mixed)):
        if i % 2:
            value = json.loads(m.outputs[0].text)        # EOS (skipped in text) pads after the JSON
            assert set(value) == {"name", "tags"} and set(value["tags"]) <= {"a", "b", "c"}
        else:
            assert m.outputs[0].token_ids == a.outputs[0].token_ids
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_kv_blocks


def test_min_tokens_masks_stop_ids_on_gpu(llm):
    free = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    first = free.outputs[0].token_ids[0]
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8, min_tokens=8,
                                                   stop_token_ids=[first]), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8 and first not in out.outputs[0].token_ids
