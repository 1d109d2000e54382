"""Verify rows sampled as decode rows (executor/spec/verify_batch.py): a drafted sequence's
emitted tokens and their logprobs equal what the plain sampler gives, row by row, for a decode
whose output history holds the tokens emitted before it (penalties), with that row's grammar
mask. A fake LM head (a fixed random projection), no model, no engine: milliseconds."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from tokenforge.config import EngineConfig
from tokenforge.core.outputs import ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from tokenforge.distributed.parallel_state import ParallelRank
from tokenforge.executor.input_batch import PreviousSample, build_inputs
from tokenforge.executor.roles import StepInFlight
from tokenforge.executor.sampler import Sampler, SamplingBatch
from tokenforge.executor.sampling_batch import PenaltyTensors
from tokenforge.executor.spec.roles import SpeculativeDriver
from tokenforge.executor.spec.verify_batch import add_draft_history, split_grammar_rows
from tokenforge.messages import WireSamplingParams

VOCAB, HIDDEN = 24, 8


class FakeHead:
    """compute_logits: hidden [R, H] @ W [H, V], W fixed."""

    def __init__(self) -> None:
        self.weight = torch.randn(HIDDEN, VOCAB, generator=torch.Generator().manual_seed(1)) * 2

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.weight


def _driver() -> SpeculativeDriver:
    config = EngineConfig.from_kwargs(model="tiny-llama", load_format="dummy", device="cpu", max_num_seqs=4)
    runner = SimpleNamespace(rank=ParallelRank(0), device=torch.device("cpu"), model=FakeHead(),
                             previous=PreviousSample(), vocab_size=VOCAB, config=config)
    return SpeculativeDriver(runner)


def _greedy_drafts(head: FakeHead, hidden: torch.Tensor, start: int, n: int) -> list[int]:
    """Drafts equal to the raw argmax of the rows before them: accepted unless a penalty or a
    mask moves the argmax."""
    return head.compute_logits(hidden[start:start + n]).argmax(dim=-1).tolist()


def _run(seqs_spec, masks=None, seed=0, banned=()):
    """seqs_spec: (params, prompt, output, num_drafts) per sequence; `banned`: the ids each bans
    before its min_tokens. Returns the driver's output, the step's hidden rows and the sequences."""
    driver = _driver()
    gen = torch.Generator().manual_seed(seed)
    total = sum(1 + d for *_, d in seqs_spec)
    hidden = torch.randn(total, HIDDEN, generator=gen)
    seqs, row = [], 0
    for i, (params, prompt, output, d) in enumerate(seqs_spec):
        drafts = _greedy_drafts(driver.model, hidden, row, d)
        if d > 1:
            drafts[-1] = (drafts[-1] + 1) % VOCAB             # the last draft is wrong
        start = len(prompt) + len(output) - 1
        ban = tuple(banned) if len(output) < params.min_tokens else ()
        seqs.append(ScheduledSequence(f"r{i}", [(prompt + output)[-1], *drafts], start, [0, 1, 2, 3], True,
                                      params, prompt, output, banned_token_ids=ban, num_draft_tokens=d))
        row += 1 + d
    grammar_rows, bitmask = masks if masks is not None else ([], None)
    sched = SchedulerOutput(seqs, grammar_rows=grammar_rows, grammar_bitmask=bitmask)
    step = StepInFlight(sched, build_inputs(seqs, 16, torch.device("cpu")))
    step.hidden, step.sampling = hidden, list(seqs)
    driver.after_forward(step, defer_sampling=False)
    out = ModelRunnerOutput()
    driver.collect(step, out)
    return out, driver.model, hidden, seqs


def _expected(head, hidden, row, seq, history, allowed=None):
    """The plain sampler's greedy token and logprobs for one decode row (EOS and stop ids banned
    before min_tokens, as the scheduler's `banned_tokens` does)."""
    banned = seq.banned_token_ids if len(history) < seq.params.min_tokens else ()
    batch = SamplingBatch.build([seq.params], [seq.prompt_token_ids], [history], [None], VOCAB, "cpu",
                                banned=[banned], **_mask_kwargs(allowed))
    out = Sampler()(head.compute_logits(hidden[row:row + 1]), batch)
    lps = out.logprobs.to_position_logprobs()[0] if out.logprobs is not None else None
    return out.token_ids.item(), lps


def _mask_kwargs(allowed):
    if allowed is None:
        return {}
    return {"grammar_rows": [0], "grammar_bitmask": _bitmask([allowed])}


def _bitmask(allowed_lists) -> np.ndarray:
    words = np.zeros((len(allowed_lists), (VOCAB + 31) // 32), dtype=np.int64)
    for r, allowed in enumerate(allowed_lists):
        for t in allowed:
            words[r, t // 32] |= 1 << (t % 32)
    return words.astype(np.uint32).view(np.int32)


def _check_rows(out, head, hidden, seqs, allowed_at=None):
    """Every sequence's emitted tokens (and logprobs) are the plain sampler's, row by row."""
    row, accepted = 0, 0
    for seq in seqs:
        emitted = out.sampled_token_ids[seq.request_id]
        assert 1 <= len(emitted) <= seq.num_draft_tokens + 1
        accepted += len(emitted) - 1
        for j, tok in enumerate(emitted):
            allowed = allowed_at.get((seq.request_id, j)) if allowed_at else None
            want, lps = _expected(head, hidden, row + j, seq, seq.output_token_ids + emitted[:j], allowed)
            assert tok == want, (seq.request_id, j, emitted)
            if lps is not None:
                got = out.logprobs[seq.request_id][j]
                assert got.token_ids == lps.token_ids and got.ranks == lps.ranks
                assert np.allclose(got.logprobs, lps.logprobs, atol=1e-6)
        if seq.params.logprobs is not None:
            assert len(out.logprobs[seq.request_id]) == len(emitted)
        row += 1 + seq.num_draft_tokens
    return accepted


def test_logprobs_and_penalties_per_row():
    specs = [
        (WireSamplingParams(temperature=0.0, logprobs=2), [1, 2, 3], [4, 5], 3),
        (WireSamplingParams(temperature=0.0, repetition_penalty=1.8), [6, 7], [8, 9, 10], 4),
        (WireSamplingParams(temperature=0.0, frequency_penalty=1.5, logprobs=0), [1], [2, 2, 3], 4),
        (WireSamplingParams(temperature=0.0, presence_penalty=2.0), [3, 4], [5], 2),
        (WireSamplingParams(temperature=0.0), [9], [9], 0),            # a plain decode beside them
    ]
    total = 0
    for seed in range(6):
        out, head, hidden, seqs = _run(specs, seed=seed)
        total += _check_rows(out, head, hidden, seqs)
    assert total > 0, "no draft was accepted: the rows after the first were never checked"


def test_penalties_see_the_drafts_before_each_row():
    """Row j counts drafts 1..j as output: a frequency penalty's counts grow along the rows."""
    drafts = torch.tensor([[5, 5, 7]])
    counts = torch.zeros(4, VOCAB)
    counts[:, 5] = 1.0                                           # the output so far: one 5
    pen = PenaltyTensors(None, None, counts > 0, torch.ones(4, 1), torch.zeros(4, 1), counts)
    got = add_draft_history(pen, drafts, 3)
    assert got.output_counts[:, 5].tolist() == [1, 2, 3, 3]
    assert got.output_counts[:, 7].tolist() == [0, 0, 0, 1]
    assert got.seen_mask[:, 7].tolist() == [False, False, False, True]


def test_grammar_masks_per_row():
    """A drafted constrained sequence gets one mask per sampling position (its last known token's,
    then each draft's); a mask that forbids the next draft's row argmax rejects it there, and the
    emitted token is the masked argmax. Masks of plain rows beside it still reach their rows."""
    specs = [
        (WireSamplingParams(temperature=0.0), [1, 2], [3], 3),                       # unconstrained
        (WireSamplingParams(temperature=0.0, logprobs=1), [4, 5], [6], 3),           # constrained, drafted
        (WireSamplingParams(temperature=0.0), [7], [8], 0),                          # constrained, plain
    ]
    everything = list(range(VOCAB))
    for seed in range(4):
        driver_head = FakeHead()
        gen = torch.Generator().manual_seed(seed)
        hidden = torch.randn(4 + 4 + 1, HIDDEN, generator=gen)
        argmax = driver_head.compute_logits(hidden).argmax(dim=-1).tolist()
        # seq r1's rows 4..7: row 5 forbids its argmax (the draft after it), row 7 (the bonus) too
        allowed = {("r1", 0): everything, ("r1", 1): [t for t in everything if t != argmax[5]],
                   ("r1", 2): everything, ("r1", 3): [t for t in everything if t != argmax[7]],
                   ("r2", 0): [t for t in everything if t != argmax[8]]}
        masks = ([4, 5, 6, 7, 8], _bitmask([allowed["r1", j] for j in range(4)] + [allowed["r2", 0]]))
        out, head, hidden, seqs = _run(specs, masks=masks, seed=seed)
        assert out.sampled_token_ids["r2"] != [argmax[8]]
        assert len(out.sampled_token_ids["r1"]) == 2          # d_1 accepted, d_2 (row 5's argmax) masked out
        _check_rows(out, head, hidden, seqs, allowed_at=allowed)


def test_grammar_rows_split_by_sampling_position():
    seqs = [SimpleNamespace(num_draft_tokens=d) for d in (2, 0, 1, 0)]
    # positions: seq 0 -> 0..2, seq 1 -> 3, seq 2 -> 4..5, seq 3 -> 6; verify rows are k + 1 = 4 per sequence
    split = split_grammar_rows(seqs, [1, 2, 3, 4, 6], k=3)
    assert (split.plain_rows, split.plain_masks) == ([0, 1], [2, 4])
    assert (split.verify_rows, split.verify_masks) == ([1, 2, 4], [0, 1, 3])


def test_min_tokens_bans_per_row():
    """Rows whose output index is before min_tokens ban EOS / stop ids, the rows after do not."""
    head = FakeHead()
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(2))      # distinct argmaxes
    top = head.compute_logits(hidden).argmax(dim=-1).tolist()
    # output has 2 tokens, min_tokens 4: rows 0 and 1 ban, rows 2.. do not; ban what rows 1 and 2 want
    params = WireSamplingParams(temperature=0.0, min_tokens=4, logprobs=0)
    out, head, hidden, seqs = _run([(params, [1, 2], [3, 4], 4)], seed=2, banned=(top[1], top[2]))
    emitted = out.sampled_token_ids["r0"]
    assert emitted[:1] == [top[0]] and len(emitted) == 2 and emitted[1] != top[1]
    _check_rows(out, head, hidden, seqs)
    out, head, hidden, seqs = _run([(params, [1, 2], [3, 4], 4)], seed=2, banned=(top[2],))
    assert out.sampled_token_ids["r0"] == top[:4]          # row 2 (output index 4) may emit it
    _check_rows(out, head, hidden, seqs)
