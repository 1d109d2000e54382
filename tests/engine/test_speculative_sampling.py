"""Speculative decoding keeps every sampling feature (issue 22, item 4): each verify row is
sampled as a decode whose history is the tokens before it. On the bundled model (GGUF-native,
where a verify step runs as decode rows, so its logits are the 1-token decode's), greedy output
with n-gram drafts equals greedy without, token for token, with logprobs (one per emitted token,
equal within fp32 rounding), with penalties, with a grammar; n > 1 and stop strings keep working.
Every test also checks that drafts were verified and accepted during it (never vacuous)."""

from __future__ import annotations

import math

import pytest

from tokenforge import LLM, SamplingParams

# Continuations that quote the prompt: n-gram drafts are found and mostly accepted.
PROMPTS = [
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,",
    "Repeat exactly: red, green, blue, red, green, blue, red, green, blue, red,",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
]


@pytest.fixture(scope="module")
def engines():
    base = LLM(max_model_len=512)
    spec = LLM(max_model_len=512, speculative_method="ngram", num_speculative_tokens=4)
    spec.engine.scheduler.drafts.adaptive = False     # every step drafts: the tests exercise verification
    yield base, spec
    base.shutdown()
    spec.shutdown()


def generate_both(engines, prompts, params):
    """(outputs without speculation, outputs with it); asserts drafts were accepted in between."""
    base, spec = engines
    drafts = spec.engine.scheduler.drafts
    before = (drafts.num_drafted, drafts.num_accepted)
    want = base.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert drafts.num_drafted > before[0] and drafts.num_accepted > before[1], "no draft was accepted"
    kv = spec.get_stats()
    assert kv.num_free_blocks == kv.num_kv_blocks, "KV blocks leaked"
    return want, got


def assert_same_logprobs(want, got, tol=1e-4):
    assert len(got.logprobs) == len(got.token_ids) == len(want.logprobs)
    for pos, (a, b) in enumerate(zip(want.logprobs, got.logprobs)):
        assert a.keys() == b.keys(), pos
        for tok in a:
            assert math.isclose(a[tok].logprob, b[tok].logprob, abs_tol=tol), (pos, tok, a[tok], b[tok])
            assert a[tok].rank == b[tok].rank or math.isclose(a[tok].logprob, b[tok].logprob, abs_tol=tol)
    assert math.isclose(want.cumulative_logprob, got.cumulative_logprob, abs_tol=tol * len(want.logprobs))


def test_logprobs_for_every_emitted_token(engines):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=3)
    want, got = generate_both(engines, PROMPTS, params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert_same_logprobs(w.outputs[0], g.outputs[0])


def test_sampled_requests_get_logprobs_of_their_tokens(engines):
    """Sampled rows (the rejection rule) with logprobs=0: one entry per token, holding that token."""
    _, spec = engines
    params = SamplingParams(temperature=0.7, max_tokens=24, ignore_eos=True, logprobs=0)
    drafts = spec.engine.scheduler.drafts
    before = drafts.num_accepted
    for out in spec.generate(PROMPTS, params, use_tqdm=False):
        c = out.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) == 24
        assert all(list(entry) == [tok] and entry[tok].logprob <= 0 for tok, entry in zip(c.token_ids, c.logprobs))
    assert drafts.num_accepted > before


def test_penalties_per_draft_position(engines):
    """Repetition, frequency and presence penalties: each verify row's penalty counts the drafts
    before it, so the greedy output is the one without speculation."""
    # strong enough that a verify row blind to the drafts before it emits other tokens here
    # (frequency 1.0 and presence 1.5 flip tokens of prompts 2 and 3 then); drafts still accepted
    for kwargs in (dict(frequency_penalty=1.0), dict(presence_penalty=1.5, repetition_penalty=1.1)):
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, **kwargs)
        want, got = generate_both(engines, PROMPTS, params)
        for w, g in zip(want, got):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids, kwargs


def _chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


COLORS = {"type": "object", "properties": {"colors": {"type": "array", "minItems": 6, "maxItems": 6,
                                                      "items": {"enum": ["red", "green", "blue"]}}},
          "required": ["colors"], "additionalProperties": False}


def test_grammar_cuts_drafts_and_masks_each_row(engines, monkeypatch):
    """A JSON schema and a regex: drafts are cut at the first token the grammar forbids, each
    verify row gets the mask after the drafts before it; greedy output equals no speculation and
    parses."""
    pytest.importorskip("llguidance")
    import json

    import jsonschema

    from tokenforge import StructuredOutputsParams

    scheduler, checks = engines[1].engine.scheduler, []
    allowed = scheduler.drafts.check          # the engine's GrammarMatchers.allowed_drafts

    def spy(request_id, drafts):
        n = allowed(request_id, drafts)
        if scheduler.requests[request_id].params.grammar is not None:
            checks.append((len(drafts), n))
        return n
    monkeypatch.setattr(scheduler.drafts, "check", spy)
    # The regexes forbid what the prompt repeats (a 3, a green): the n-gram drafts run into
    # forbidden tokens (cut there) and rows after accepted drafts must be masked (without their
    # masks the 3s and greens come back)
    prompts = [_chat("List six colors as JSON: red, green, blue, red, green, blue."), PROMPTS[0], PROMPTS[1],
               PROMPTS[2]]
    regex = [StructuredOutputsParams(regex=r"( [0-24-9],)+"), StructuredOutputsParams(regex=r"( (red|blue),)+")]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=COLORS)),
              *(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, structured_outputs=r) for r in regex),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]     # unconstrained beside them
    want, got = generate_both(engines, prompts, params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    jsonschema.validate(json.loads(got[0].outputs[0].text), COLORS)
    assert any(n > 0 for _, n in checks), "no constrained request kept a draft"
    assert any(n < d for d, n in checks), "no draft was cut by its grammar"


def test_n_and_stop_strings(engines):
    """n > 1 (each child drafts on its own) and stop strings met inside a list of accepted
    tokens (the tokens after the stop are dropped, logprobs with them): as without speculation."""
    stop = SamplingParams(temperature=0, max_tokens=24, n=2, stop=["2, 3, 4", "blue, red, green"], logprobs=1)
    want, got = generate_both(engines, PROMPTS, stop)
    for w, g in zip(want, got):
        assert len(g.outputs) == 2
        for a, b in zip(w.outputs, g.outputs):
            assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == (a.text, a.token_ids, a.finish_reason,
                                                                           a.stop_reason)
            assert len(b.logprobs) == len(b.token_ids)
    assert [o.outputs[0].stop_reason for o in got[:2]] == stop.stop
    _, spec = engines
    sampled = SamplingParams(temperature=0.8, max_tokens=12, n=3, ignore_eos=True)
    for out in spec.generate(PROMPTS[:1], sampled, use_tqdm=False):
        assert [len(c.token_ids) for c in out.outputs] == [12] * 3


def test_min_tokens_bans_eos_per_row(engines):
    """A short answer's EOS (which the n-gram drafts, copied from the prompt's turn end) is banned
    at every verify row before min_tokens and allowed after it."""
    prompts = [_chat("Repeat exactly: red, green, blue"), _chat("Repeat exactly: 1, 2, 3, 4")]
    params = SamplingParams(temperature=0, max_tokens=40, min_tokens=12)
    want, got = generate_both(engines, prompts, params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.outputs[0].token_ids) >= 12


def test_allowed_drafts_cut_at_the_first_forbidden_token_or_eos():
    """The grammar's check of a draft (llguidance's validate_tokens), cut before an id the
    device fills in later and before EOS (a stopped matcher has no mask for the row after it)."""
    pytest.importorskip("llguidance")
    from tokenforge import StructuredOutputsParams
    from tokenforge.core.outputs import DRAFT_TOKEN_ID
    from tokenforge.engine.structured_output import GrammarMatchers, compile_grammar
    from tokenforge.engine.tokenization import load_engine_tokenizer

    tokenizer = load_engine_tokenizer(None)
    grammars = GrammarMatchers(lambda: tokenizer, 49152)
    grammars.add("g", compile_grammar(StructuredOutputsParams(regex="(yes|no)+")))
    yes, no, eos = tokenizer.encode("yes")[0], tokenizer.encode("no")[0], tokenizer.eos_token_ids[0]
    assert grammars.allowed_drafts("g", [yes, no, yes]) == 3
    assert grammars.allowed_drafts("g", [yes, tokenizer.encode(" maybe")[0], no]) == 1
    assert grammars.allowed_drafts("g", [yes, eos, no]) == 1
    assert grammars.allowed_drafts("g", [DRAFT_TOKEN_ID] * 3) == 0
    assert grammars.allowed_drafts("free", [yes, eos, 7]) == 3          # no grammar: all of them


def test_seeded_requests_draft_and_keep_their_output(engines):
    """Seeded sampled requests draft: each verify row draws from the request's own generator, which
    is rewound to the draws of the tokens emitted, so the output is the one without speculation,
    the same run after run and alone or beside other requests."""
    base, spec = engines
    seeded = [SamplingParams(temperature=0.8, seed=seed, max_tokens=32, ignore_eos=True) for seed in (11, 12)]
    prompts = PROMPTS[:2]
    drafts = spec.engine.scheduler.drafts
    before = (drafts.num_drafted, drafts.num_accepted)

    def alone():
        return [spec.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, seeded)]
    first = alone()
    assert drafts.num_drafted > before[0] and drafts.num_accepted > before[1], "no seeded draft was accepted"
    others = [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    mixed = spec.generate([PROMPTS[2], prompts[0], PROMPTS[1], prompts[1]], [others[0], seeded[0], others[1], seeded[1]],
                          use_tqdm=False)
    without = [o.outputs[0].token_ids for o in base.generate(prompts, seeded, use_tqdm=False)]
    assert first == alone() == [mixed[1].outputs[0].token_ids, mixed[3].outputs[0].token_ids] == without
    assert len(set(map(tuple, first))) == 2
    kv = spec.get_stats()
    assert kv.num_free_blocks == kv.num_kv_blocks, "KV blocks leaked"


def test_logit_bias_on_every_verify_row(engines):
    """A logit bias applies to each verify row as to a decode: greedy output equals the output
    without speculation (and the bias changes it: a verify that took the raw argmax would not)."""
    base, _ = engines
    plain = base.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                             logit_bias={p.outputs[0].token_ids[6]: 4.0, p.outputs[0].token_ids[2]: -100.0})
              for p in plain]
    want, got = generate_both(engines, PROMPTS, params)
    for p, w, g in zip(plain, want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert w.outputs[0].token_ids != p.outputs[0].token_ids
