"""Structured outputs and min_tokens on the GPU path (async scheduling on): constrained requests
force the synchronous path, their outputs follow the grammar, and free rows in a mixed batch
produce the tokens they produce alone."""

from __future__ import annotations

import json

import pytest
import torch

from tokenforge import LLM, SamplingParams, StructuredOutputsParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "tags": {"type": "array", "maxItems": 3,
                                                    "items": {"enum": ["a", "b", "c"]}}},
          "required": ["name", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=16, num_kv_blocks=256, dtype="float32")


def test_mixed_batch_on_gpu(llm):
    assert llm.engine.async_scheduling
    prompts = [f"Describe person number {i} as JSON." for i in range(8)]
    free = SamplingParams(temperature=0, max_tokens=24)
    alone = llm.generate(prompts, free, use_tqdm=False)
    constrained = SamplingParams(temperature=0, max_tokens=80,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    mixed = llm.generate(prompts, [constrained if i % 2 else free for i in range(8)], use_tqdm=False)
    for i, (a, m) in enumerate(zip(alone, mixed)):
        if i % 2:
            value = json.loads(m.outputs[0].text)
            assert set(value) == {"name", "tags"} and len(value["name"]) <= 16
        else:
            assert m.outputs[0].token_ids == a.outputs[0].token_ids
    assert llm.get_stats().num_free_blocks == llm.get_stats().num_kv_blocks


def test_min_tokens_on_gpu(llm):
    prompt = "Q: What is 17 times 23?\nA:"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, min_tokens=24), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 24
    assert not set(llm.tokenizer.eos_token_ids) & set(out.outputs[0].token_ids)
