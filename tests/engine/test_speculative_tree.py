"""Tree drafts (--speculative-tree: eagle, batch 1, the torch attention backend): greedy output
equals greedy without speculation, token for token, on the bundled model with an EAGLE head, and
no KV block leaks. A random head's first-choice path through the tree drafts what the chain
drafter drafts (the head's tree attention is the chain's, level by level); an oracle that plants
the target's own continuation on a side branch (the head's second choice) is accepted there, and
the accepted nodes' KV, hidden states and ids are moved where a chain's would be."""

from __future__ import annotations

import pytest
import torch

from tokenforge import LLM, SamplingParams
from tokenforge.config.draft_tree import DraftTree

from tests.engine.conftest import SPEC_PROMPTS as PROMPTS
from tests.executor.spec.eagle_heads import write_eagle1, write_eagle3

TREE = DraftTree.build(8)                # (-1, 0, 0, 1, 1, 3, 5, 6, 7): first choices 1-3-5-6-7-8
FIRST_CHOICES = [1, 3, 5, 6, 7, 8]
MAX_TOKENS = 24
SEEDED = SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)


def _engine(**kw):
    return LLM(num_kv_blocks=256, max_model_len=1024, block_size=16, dtype="float32", max_num_seqs=1, **kw)


def _greedy(llm, prompts, max_tokens=MAX_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _speculative(head, k, tree):
    llm = _engine(speculative_method="eagle", speculative_model=head, num_speculative_tokens=k, speculative_tree=tree)
    llm.engine.scheduler.drafts.adaptive = False          # draft every step: the verify path runs throughout
    return llm


def _assert_no_leak(llm):
    kv = llm.get_stats()
    assert kv.num_free_blocks == kv.num_kv_blocks, "KV blocks leaked"


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return write_eagle1(tmp_path_factory.mktemp("head") / "eagle")


@pytest.fixture(scope="module")
def baseline(greedy_without_speculation):
    """Without speculation, per prompt of the first three (the tests use no other): (its token
    ids, its greedy output: the first MAX_TOKENS of the run's shared greedy reference, which the
    engine gives alone as batched); and the first two prompts' seeded samples, from an engine of
    one sequence at a time (the third prompt, one token, only for its ids)."""
    llm = _engine()
    params = [SEEDED, SEEDED, SamplingParams(temperature=0.0, max_tokens=1)]
    outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    llm.shutdown()
    greedy = [(o.prompt_token_ids, ids[:MAX_TOKENS]) for o, ids in zip(outs, greedy_without_speculation)]
    return greedy, [o.outputs[0].token_ids for o in outs[:2]]


@pytest.fixture(scope="module")
def tree_engine(head):
    llm = _speculative(head, 8, tree=True)
    yield llm
    llm.shutdown()


def _record_drafts(llm, nodes=None):
    """Per drafting step: the draft tokens written into the step's inputs (`nodes`: those nodes only)."""
    drafter, seen = llm.engine.executor.runner.drafter, []
    real = drafter.before_forward

    def spy(step):
        real(step)
        for i, s in enumerate(step.sched.sequences):
            m = s.num_draft_tokens
            if m:
                root = step.inputs.query_start_loc[i]
                ids = step.inputs.input_ids[root:root + 1 + m].tolist()
                seen.append([ids[j] for j in (nodes or range(1, m + 1)) if j <= m])
    drafter.before_forward = spy
    return seen


def test_a_random_head_is_exact_and_its_first_choices_are_the_chain_drafts(baseline, head, tree_engine):
    some = PROMPTS[:2]                 # two prompts x 24 tokens: ~45 drafting steps (the suite's time)
    tree_drafts = _record_drafts(tree_engine, FIRST_CHOICES)
    got = _greedy(tree_engine, some)
    del tree_engine.engine.executor.runner.drafter.before_forward
    assert got == [want for _, want in baseline[0][:len(some)]]
    stats = tree_engine.engine.scheduler.drafts.stats()
    assert stats["num_draft_tokens"] > 5 * len(some) * 8, stats       # nearly every step drafted 8 nodes
    _assert_no_leak(tree_engine)
    chain = _speculative(head, len(FIRST_CHOICES), tree=False)
    chain_drafts = _record_drafts(chain)
    assert _greedy(chain, some) == [want for _, want in baseline[0][:len(some)]]
    chain.shutdown()
    assert len(tree_drafts) > 20 and tree_drafts == chain_drafts


class Oracle:
    """Replaces the head's expansion: the planted leaf's path gets the target's own continuation
    (`truth`: prompt + greedy output, by position), every other node a token off it."""

    LEAVES = (4, 2, 8, 6, 3)

    def __init__(self, truth: list[int], greedy: bool) -> None:
        self.truth, self.greedy, self.calls, self.planted = truth, greedy, 0, None

    def expand(self, inputs, i, root, n, rows, hidden):
        start = inputs.attn_batch.context_lens[i]
        path = [p for p in TREE.ancestors(self.LEAVES[self.calls % len(self.LEAVES)]) if p < n]
        self.calls += 1
        tokens = [self.truth[start + TREE.depths[j]] + (0 if j in path else 1 + j) for j in range(1, n)]
        inputs.input_ids[root + 1:root + n] = torch.tensor(tokens)
        self.planted = (start, root, len(path) - 1)


def test_paths_through_side_branches_are_accepted_and_moved(baseline, tree_engine, monkeypatch):
    """Greedy and seeded: the oracle plants the output without speculation, which the verify
    accepts (a seeded request's nodes draw the noise its decodes would)."""
    runner = tree_engine.engine.executor.runner
    drafter, accepted, realigned = runner.drafter, [], []
    real_realign = drafter._realign_previous

    def realign():
        prev, planted = drafter._last[0] if drafter._last else None, oracle.planted
        moved = prev is not None and prev.accepted_rows is not None
        real_realign()
        if moved and planted is not None:       # the accepted rows now sit where a chain's would
            start, root, a = planted
            ids = prev.inputs.input_ids[root:root + a + 1].tolist()
            argmax = runner.model.compute_logits(prev.hidden[root:root + a + 1]).argmax(-1).tolist()
            greedy = argmax == oracle.truth[start + 1:start + a + 2]     # the hidden rows of the path, in order
            realigned.append(ids == oracle.truth[start:start + a + 1] and (greedy or not oracle.greedy))
            accepted.append(a)
    monkeypatch.setattr(drafter, "_realign_previous", realign)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (greedy_runs, seeded_runs), planner = baseline, tree_engine.engine.scheduler.drafts
    runs = [(ids, want, greedy) for ids, want in greedy_runs[:3]] + [(greedy_runs[1][0], seeded_runs[1], SEEDED)]
    for prompt_ids, want, params in runs:
        oracle = Oracle(prompt_ids + want, params.temperature == 0)
        monkeypatch.setattr(drafter, "_expand", oracle.expand)
        before = planner.num_accepted
        out = tree_engine.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
        assert out[0].outputs[0].token_ids == want
        assert planner.num_accepted - before > MAX_TOKENS // 2          # most tokens came as accepted drafts
        _assert_no_leak(tree_engine)
    assert realigned and all(realigned)
    assert {1, 2, 6} <= set(accepted), accepted          # node 2 (a second choice), node 4 (under 1), the chain


def test_other_requests_decode_beside_trees_and_an_eagle3_head_is_exact(baseline, tmp_path):
    """A logprobs request gets no tree (it decodes a token a step); a seeded sampled one does: both
    give the output without speculation; an EAGLE-3 head's tree is exact too."""
    llm = _speculative(write_eagle3(tmp_path / "v3"), 8, tree=True)
    planner, drafted = llm.engine.scheduler.drafts, set()
    check = planner.check
    planner.check = lambda rid, drafts: drafted.add(rid) or check(rid, drafts)
    params = [SEEDED, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)]
    got = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    _assert_no_leak(llm)
    llm.shutdown()
    greedy, seeded = baseline
    assert [o.outputs[0].token_ids for o in got] == [seeded[0], greedy[1][1], greedy[2][1]]
    assert len(got[1].outputs[0].logprobs) == MAX_TOKENS
    assert sorted(rid.split("-")[0] for rid in drafted) == sorted([got[0].request_id, got[2].request_id]), drafted


def test_bad_tree_settings_are_refused_before_loading(head):
    with pytest.raises(ValueError, match="needs speculative_method='eagle', got 'ngram'"):
        LLM(speculative_method="ngram", speculative_tree=True)
    with pytest.raises(ValueError, match="needs max_num_seqs=1, got 4"):
        LLM(speculative_method="eagle", speculative_model=head, speculative_tree=True, max_num_seqs=4)
    with pytest.raises(ValueError, match="need speculative_method"):
        LLM(speculative_tree=True)
