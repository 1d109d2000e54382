"""min_tokens masks EOS and stop_token_ids in the sampler until reached, as HF's min_new_tokens."""

from __future__ import annotations

import pytest

from tokenforge import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "Q: What is 17 times 23?\nA:"


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=4, num_kv_blocks=64, dtype="float32")   # HF's arithmetic: the float path


def test_min_tokens_matches_hf_min_new_tokens(llm, hf_reference):
    import torch

    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, min_tokens=24), use_tqdm=False)[0]
    ids = out.outputs[0].token_ids
    eos = set(llm.tokenizer.eos_token_ids)
    assert len(ids) == 24 and not eos & set(ids), ids       # EOS was the argmax at 22: now masked
    free = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert len(free.outputs[0].token_ids) < 24              # without min_tokens it stops at EOS

    _, model = hf_reference
    prompt_ids = torch.tensor([out.prompt_token_ids])
    with torch.inference_mode():
        hf = model.generate(prompt_ids, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                            attention_mask=torch.ones_like(prompt_ids), eos_token_id=sorted(eos),
                            pad_token_id=sorted(eos)[0])
    assert hf[0, prompt_ids.shape[1]:].tolist() == ids


def test_min_tokens_masks_stop_token_ids_and_ignore_eos_keeps_eos(llm):
    free = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    first = free.outputs[0].token_ids[0]
    banned = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, min_tokens=3,
                                                   stop_token_ids=[first]), use_tqdm=False)[0]
    assert banned.outputs[0].token_ids[0] != first and len(banned.outputs[0].token_ids) >= 3
    # ignore_eos keeps vLLM's meaning: EOS may be sampled, it just does not stop the request.
    kept = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    assert set(llm.tokenizer.eos_token_ids) & set(kept.outputs[0].token_ids)
