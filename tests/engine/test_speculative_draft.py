"""The `draft` method: a draft model proposes on the device, the target verifies; greedy output
equals greedy without speculation, token for token, with the bundled model drafting for itself
(acceptance ~1) and with a tiny random model of the same vocabulary (acceptance ~0); bad drafts
are refused before any model loads."""

from __future__ import annotations

import pytest

from tokenforge import LLM, SamplingParams
from tokenforge.source import find_bundled_gguf

from tests.engine.conftest import SPEC_PROMPTS as PROMPTS

VOCAB = 49152       # the bundled SmolLM2's


def _tiny_draft(path, vocab: int = VOCAB):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return str(path)


def _engine(**kw):
    return LLM(num_kv_blocks=256, max_model_len=1024, block_size=16, dtype="float32", **kw)


@pytest.fixture(scope="module")
def baseline(greedy_without_speculation):
    """PROMPTS' greedy ids without speculation, 24 tokens (`_run_draft`'s)."""
    return [ids[:24] for ids in greedy_without_speculation]


def _run_draft(draft_path: str):
    llm = _engine(speculative_method="draft", speculative_model=draft_path, num_speculative_tokens=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ids = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    stats = llm.engine.scheduler.drafts.stats()
    kv = llm.get_stats()
    llm.shutdown()
    assert kv.num_free_blocks == kv.num_kv_blocks, "KV blocks leaked"
    return ids, stats


def test_the_bundled_model_drafting_for_itself(baseline):
    ids, stats = _run_draft(str(find_bundled_gguf()))
    for i, (a, b) in enumerate(zip(baseline, ids)):
        assert a == b, f"prompt {i}: {a} != {b}"
    assert stats["num_draft_tokens"] > 0 and stats["acceptance_rate"] > 0.9, stats


def test_a_tiny_random_draft_is_rejected_but_exact(baseline, tmp_path):
    ids, stats = _run_draft(_tiny_draft(tmp_path / "draft"))
    for i, (a, b) in enumerate(zip(baseline, ids)):
        assert a == b, f"prompt {i}: {a} != {b}"
    assert stats["num_draft_tokens"] > 0 and stats["acceptance_rate"] < 0.3, stats


@pytest.mark.parametrize("kwargs,message", [
    ({"speculative_method": "draft"}, "needs speculative_model"),
    ({"speculative_method": "draft", "speculative_model": "/nonexistent/draft"}, "cannot be read"),
    ({"speculative_method": "draft", "speculative_model": "x", "num_speculative_tokens": 17}, "between 1 and 16"),
])
def test_bad_drafts_are_refused_before_loading(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(**kwargs)


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    path = _tiny_draft(tmp_path / "small-vocab", vocab=1000)
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens, the target 49152"):
        LLM(speculative_method="draft", speculative_model=path)
