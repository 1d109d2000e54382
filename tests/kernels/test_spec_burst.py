"""The burst iteration's kernels (kernels/spec_burst.py) against their torch references: the n-gram
lookup over random histories (matches found and not, exact and re-synchronised, lengths across
the kernel's 512-position chunks), the
rows and metadata (live and capturing), and the greedy accept with its counters, over several
iterations. GPU, or Triton's interpreter on the CPU; the references themselves are checked against
the host lookup and the engine in tests/engine/test_speculative_burst.py."""

from __future__ import annotations

import random

import pytest
import torch

from tokenforge.kernels import spec_burst as sb


@pytest.mark.parametrize("ngram_min,ngram_max,k,resync", [(1, 4, 4, True), (1, 4, 4, False), (2, 3, 7, True),
                                                           (3, 3, 1, False)])
def test_the_ngram_kernel_equals_the_reference(device, ngram_min, ngram_max, k, resync):
    rng = random.Random(k)
    capacity = 2100                      # sources past several chunks of 512
    for trial in range(12):
        length = rng.choice([1, 2, 5, 300, 1500, capacity])
        vocab = rng.choice([3, 7, 50, 5000])
        hist = torch.randint(vocab, (capacity + k + 1,), generator=torch.Generator().manual_seed(trial)).to(device)
        state = torch.tensor([length, 0, 1], device=device)
        got = (torch.zeros(k, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, device=device))
        want = (torch.zeros(k, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        sb.ngram_propose(hist, state, *got, ngram_min, ngram_max, capacity, resync)
        sb.ngram_propose_ref(hist.cpu(), state.cpu(), *want, ngram_min, ngram_max, capacity, resync)
        n = int(want[1])
        assert int(got[1]) == n, (trial, length)
        assert got[0][:n].tolist() == want[0][:n].tolist(), (trial, length)


@pytest.mark.parametrize("resync", [True, False])
def test_the_ngram_kernel_resyncs_past_a_replaced_token(device, resync):
    # 0..999 (past one chunk), then 500, 501 and a new token where 502 stood: with resync, the
    # drafts go on from 503; without, nothing matches the last token
    capacity, k = 1100, 4
    history = list(range(1000)) + [500, 501, 7777]
    hist = torch.tensor(history + [0] * (capacity + k + 1 - len(history)))
    for fn, dev in ((sb.ngram_propose, device), (sb.ngram_propose_ref, torch.device("cpu"))):
        drafts, found = torch.zeros(k, dtype=torch.long, device=dev), torch.zeros(1, dtype=torch.long, device=dev)
        fn(hist.to(dev), torch.tensor([len(history), 0, 1], device=dev), drafts, found, 1, 4, capacity, resync)
        assert drafts.cpu()[:int(found)].tolist() == ([503, 504, 505, 506] if resync else [])


@pytest.mark.parametrize("live", [1, 0])
def test_the_rows_kernel_equals_the_reference(device, live):
    k, block_size = 4, 16
    hist = torch.arange(100, 300, device=device)
    table = torch.tensor([7, 3, 9, 1], dtype=torch.int32, device=device)
    drafts = torch.tensor([11, 12, 13, 14], device=device)
    state = torch.tensor([30, 0, live], device=device)         # rows at positions 29..33 cross a block

    def run(fn, dev):
        out = [torch.zeros(k + 1, dtype=torch.long, device=dev) for _ in range(2)]
        out += [torch.zeros(k + 1, dtype=torch.int32, device=dev) for _ in range(3)]
        fn(hist.to(dev), state.to(dev), drafts.to(dev), table.to(dev), block_size, *out)
        return [t.cpu().tolist() for t in out]

    got, want = run(sb.prepare_rows, device), run(sb.prepare_rows_ref, torch.device("cpu"))
    assert got == want
    assert want[0] == [129, 11, 12, 13, 14] and want[1] == [29, 30, 31, 32, 33]
    assert want[2] == ([3 * 16 + 13, 3 * 16 + 14, 3 * 16 + 15, 9 * 16, 9 * 16 + 1] if live else [-1] * 5)


def test_the_accept_kernel_equals_the_reference_over_iterations(device):
    k, steps, capacity = 4, 5, 64
    rng = random.Random(3)

    def fresh(dev):
        hist = torch.arange(capacity + k + 1, device=dev) % 7
        return (torch.tensor([10, 0, 1], device=dev), torch.zeros(1 + 2 * steps, dtype=torch.long, device=dev),
                hist, torch.zeros(steps * (k + 1) + k + 1, dtype=torch.long, device=dev))

    got, want = fresh(device), fresh(torch.device("cpu"))
    # no stop id among 0..5, budget and slots never reached: `go` stays set
    limits = torch.tensor([1000, 1000] + [-1] * 4 + [77] * 4)
    go_got, go_want = torch.zeros((), dtype=torch.bool, device=device), torch.zeros((), dtype=torch.bool)
    for _ in range(steps):
        pred = torch.tensor([rng.randrange(5) for _ in range(k + 1)])
        drafts = pred[:k].clone()
        miss = rng.randrange(k + 1)                    # drafts agree up to here
        if miss < k:
            drafts[miss] = 9
        found = torch.tensor([rng.randrange(k + 1)])
        sb.accept_update(pred.to(device), drafts.to(device), found.to(device), *got, limits.to(device), go_got)
        sb.accept_update_ref(pred, drafts, found, *want, limits, go_want)
        # the references write rejected rows into the scratch tails; the kernel writes nothing there
        cut = (None, None, capacity, steps * (k + 1))
        assert [t.cpu()[:c].tolist() for t, c in zip(got, cut)] == [t[:c].tolist() for t, c in zip(want, cut)]
        assert bool(go_got) is bool(go_want) is True
    state, counts = want[0].tolist(), want[1].tolist()
    assert state[1] == steps and state[0] == 10 + counts[0]
    assert counts[0] == sum(a + 1 for a in counts[2::2])


@pytest.mark.parametrize("case,limits,go", [
    ("nothing ends it", [100, 100, 50, -1], True),
    ("a stop id among the kept tokens", [100, 100, 22, -1], False),
    ("a stop id only in a rejected row", [100, 100, 33, 44], True),
    ("the token budget reached", [3, 100, -1, -1], False),
    ("one token of budget left", [4, 100, -1, -1], True),
    ("the next iteration's rows past the slots", [100, 6, -1, -1], False),
    ("the next iteration's rows just fit", [100, 7, -1, -1], True),
])
def test_the_accept_kernel_says_whether_another_iteration_may_run(device, case, limits, go):
    """An iteration of K = 4 that accepts 2 drafts: tokens 11, 22, then the target's 30 (rows 3-4,
    33 and 44, are rejected); 3 tokens emitted, so the next rows reach slot 3 + 4 = 7."""
    k = 4
    pred = torch.tensor([11, 22, 30, 33, 44])
    drafts, found = torch.tensor([11, 22, 5, 6]), torch.tensor([4])
    for fn, dev in ((sb.accept_update, device), (sb.accept_update_ref, torch.device("cpu"))):
        state = torch.tensor([10, 0, 1], device=dev)
        counts = torch.zeros(3, dtype=torch.long, device=dev)
        hist = torch.zeros(32, dtype=torch.long, device=dev)
        out = torch.zeros(2 * (k + 1), dtype=torch.long, device=dev)
        flag = torch.ones((), dtype=torch.bool, device=dev)
        fn(pred.to(dev), drafts.to(dev), found.to(dev), state, counts, hist, out, torch.tensor(limits, device=dev),
           flag)
        assert counts.tolist()[:1] == [3] and hist[10:13].tolist() == [11, 22, 30], case
        assert bool(flag) is go, (case, str(dev))


def test_drafts_past_max_tokens_are_not_verified(device):
    """Two tokens left of max_tokens: of the 4 drafts only the first counts (found 1), so the
    iteration emits it and the target's next token, then stops."""
    pred, drafts, found = torch.tensor([11, 22, 30, 33, 44]), torch.tensor([11, 22, 33, 44]), torch.tensor([4])
    for fn, dev in ((sb.accept_update, device), (sb.accept_update_ref, torch.device("cpu"))):
        state, counts = torch.tensor([10, 0, 1], device=dev), torch.zeros(3, dtype=torch.long, device=dev)
        hist, out = torch.zeros(32, dtype=torch.long, device=dev), torch.zeros(10, dtype=torch.long, device=dev)
        flag = torch.ones((), dtype=torch.bool, device=dev)
        fn(pred.to(dev), drafts.to(dev), found.to(dev), state, counts, hist, out,
           torch.tensor([2, 100, -1, -1], device=dev), flag)
        assert counts.tolist() == [2, 1, 1] and out[:2].tolist() == [11, 22] and not bool(flag), str(dev)
