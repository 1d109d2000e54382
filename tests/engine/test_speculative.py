"""Speculative decoding (n-gram) is exact: greedy output equals greedy without it, token for
token, on the bundled model; KV blocks all come back; bad settings are refused before loading."""

from __future__ import annotations

import pytest

from tests.engine.conftest import SPEC_MAX_TOKENS, spec_engine
from tests.engine.conftest import SPEC_PROMPTS as PROMPTS
from tokenforge import LLM, SamplingParams


@pytest.fixture(scope="module")
def outputs(greedy_without_speculation):
    """Per method (None: without speculation), the greedy ids of PROMPTS and the engine."""
    params = SamplingParams(temperature=0.0, max_tokens=SPEC_MAX_TOKENS, ignore_eos=True)
    llm = spec_engine(speculative_method="ngram", num_speculative_tokens=4)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    yield {None: (greedy_without_speculation, None), "ngram": ([o.outputs[0].token_ids for o in outs], llm)}
    llm.shutdown()


def test_greedy_output_is_unchanged(outputs):
    base, spec = outputs[None][0], outputs["ngram"][0]
    for i, (a, b) in enumerate(zip(base, spec)):
        assert a == b, f"prompt {i}: {a} != {b}"


def test_drafts_were_accepted_and_blocks_freed(outputs):
    llm = outputs["ngram"][1]
    stats = llm.engine.scheduler.drafts.stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] > 0
    kv = llm.get_stats()
    assert kv.num_free_blocks == kv.num_kv_blocks, "KV blocks leaked"
    assert kv.num_running == kv.num_waiting == 0
    spec = kv.spec_decode           # what /metrics exports
    assert (spec.num_draft_tokens, spec.num_accepted_tokens) == (stats["num_draft_tokens"], stats["num_accepted_tokens"])
    per_pos = spec.accepted_per_position
    assert len(per_pos) == 4 and sum(per_pos) == spec.num_accepted_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos     # a draft is accepted up to its first miss
    assert per_pos[0] <= spec.num_drafts


def test_sampled_and_async_steps_with_drafts(outputs):
    """Sampled requests beside greedy ones in drafted steps (the rejection rule on the device), and
    an engine whose non-drafting steps are scheduled ahead: the greedy output is unchanged."""
    llm = outputs["ngram"][1]
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 2
    before = llm.engine.scheduler.drafts.num_verify_steps
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [24] * 4
    assert outs[1].outputs[0].token_ids == outputs[None][0][1][:24]
    assert llm.engine.scheduler.drafts.num_verify_steps > before
    kv = llm.get_stats()
    assert kv.num_free_blocks == kv.num_kv_blocks, "KV blocks leaked"
    llm.engine.async_scheduling = True
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        ids = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    finally:
        llm.engine.async_scheduling = False
    assert ids == outputs[None][0]
    kv = llm.get_stats()
    assert kv.num_free_blocks == kv.num_kv_blocks, "KV blocks leaked"


def test_spec_decode_counters_in_metrics():
    from tokenforge.messages import EngineStats, SpecDecodeStats
    from tokenforge.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.update_engine(EngineStats(spec_decode=SpecDecodeStats(3, 12, 7, [3, 2, 1, 1])))
    metrics.update_engine(EngineStats(spec_decode=SpecDecodeStats(5, 20, 9, [4, 3, 1, 1])))
    text = metrics.render().decode()
    for line in ('tokenforge:spec_decode_num_drafts_total{model_name="m"} 5.0',
                 'tokenforge:spec_decode_num_draft_tokens_total{model_name="m"} 20.0',
                 'tokenforge:spec_decode_num_accepted_tokens_total{model_name="m"} 9.0',
                 'tokenforge:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 4.0',
                 'tokenforge:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 3.0'):
        assert line in text, line


@pytest.mark.parametrize("kwargs,message", [
    ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "between 1 and 16"),
    ({"speculative_method": "ngram", "num_speculative_tokens": 17}, "between 1 and 16"),
    ({"speculative_method": "ngram", "speculative_model": "x"}, "ngram looks drafts up"),
    ({"speculative_method": "medusa"}, "must be one of ngram, draft, eagle"),
    ({"num_speculative_tokens": 3}, "need speculative_method"),
])
def test_bad_settings_are_refused_before_loading(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(**kwargs)
