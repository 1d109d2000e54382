"""A constraint that starts after a marker (`StructuredOutputsParams.after_token_ids`, what the
server sets from --reasoning-parser so that only a reasoning model's answer is constrained, as
vLLM does): the output is the unconstrained one up to and including the marker, then follows the
grammar; with async scheduling on and off, with n-gram speculation (drafts are cut before the
marker's last id), and a marker that never comes leaves the output unconstrained."""

from __future__ import annotations

import re

import pytest

from tokenforge import LLM, SamplingParams, StructuredOutputsParams

pytest.importorskip("llguidance")

PROMPTS = ["The capital of France is", "Repeat exactly: red, green, blue, red, green, blue, red, green, blue, red,",
           "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,"]
DIGITS = "[0-9]{2,5}"


@pytest.fixture(scope="module")
def engines():
    base = LLM(max_model_len=512, async_scheduling=True)
    spec = LLM(max_model_len=512, speculative_method="ngram", num_speculative_tokens=4)
    spec.engine.scheduler.drafts.adaptive = False     # every step drafts
    yield base, spec
    base.shutdown()
    spec.shutdown()


def _plain(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _markers(plain: list[list[int]]) -> list[list[int]]:
    """Per prompt, two tokens of its own greedy output from position 3 on: the earliest such pair."""
    return [ids[3:5] for ids in plain]


def _after_params(markers, max_tokens=40) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=max_tokens,
                           structured_outputs=StructuredOutputsParams(regex=DIGITS, after_token_ids=m))
            for m in markers]


def _check(llm: LLM, plain, markers, outs) -> list[list[int]]:
    got = []
    for ids, marker, out in zip(plain, markers, outs):
        c = out.outputs[0]
        end = next(i + 2 for i in range(len(ids) - 1) if ids[i:i + 2] == marker)
        assert c.token_ids[:end] == ids[:end], "the output before the marker must be unconstrained"
        rest = llm.get_tokenizer().decode(c.token_ids[end:], skip_special_tokens=True)
        assert re.fullmatch(DIGITS, rest), (rest, c.text)
        assert c.finish_reason == "stop"
        got.append(c.token_ids)
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_kv_blocks, "KV blocks leaked"
    assert len(llm.engine.grammars) == 0, "a grammar outlived its request"
    return got


def test_grammar_starts_after_the_marker_with_async_scheduling_on_and_off(engines):
    base, _ = engines
    plain = _plain(base)
    markers = _markers(plain)
    runs = []
    for on in (False, True):
        base.engine.async_scheduling = on
        runs.append(_check(base, plain, markers, base.generate(PROMPTS, _after_params(markers), use_tqdm=False)))
    assert runs[0] == runs[1]


def test_with_ngram_drafts_the_output_is_the_same(engines):
    base, spec = engines
    plain = _plain(base)
    markers = _markers(plain)
    base.engine.async_scheduling = True
    want = base.generate(PROMPTS, _after_params(markers), use_tqdm=False)
    drafts = spec.engine.scheduler.drafts
    before = drafts.num_accepted
    got = spec.generate(PROMPTS, _after_params(markers), use_tqdm=False)
    assert drafts.num_accepted > before, "no draft was accepted"
    assert _check(spec, plain, markers, got) == [o.outputs[0].token_ids for o in want]


def test_a_marker_that_never_comes_leaves_the_output_free(engines):
    base, _ = engines
    plain = _plain(base)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(regex=DIGITS, after_token_ids=[0, 0, 0]))
    outs = base.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert len(base.engine.grammars) == 0


def test_bad_markers_are_refused(engines):
    base, _ = engines
    with pytest.raises(ValueError, match="after_token_ids must be a non-empty list"):
        StructuredOutputsParams(regex=DIGITS, after_token_ids=[])
    with pytest.raises(ValueError, match="after_token_ids holds"):
        base.generate("hi", SamplingParams(structured_outputs=StructuredOutputsParams(
            regex=DIGITS, after_token_ids=[10**7])), use_tqdm=False)
