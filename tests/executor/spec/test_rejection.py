"""Exactness of draft verification: greedy equals the target's argmax chain; sampled output is
distributed as the target's own samples (chi-square over many rows of one batched call)."""

from __future__ import annotations

import torch

from tokenforge.executor.spec.rejection import verify

# chi-square critical value for 4 degrees of freedom at p = 1e-4 (the test has a fixed seed; a
# wrong rule, e.g. accepting every draft, gives statistics in the thousands at these sizes)
CHI2_DF4_P1E4 = 23.51


def _chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_accepts_the_matching_prefix_then_corrects():
    v = 6
    probs = torch.zeros(3, 3, v)
    argmax = torch.tensor([[1, 2, 3], [1, 2, 3], [5, 0, 0]])
    probs.scatter_(2, argmax[..., None], 1.0)
    probs = 0.5 * probs + 0.5 / v
    drafts = torch.tensor([[1, 2, 3], [1, 5, 3], [0, 0, 0]])
    bonus = torch.tensor([4, 4, 5])     # the sampler's token after the last draft
    out = verify(probs, drafts, torch.tensor([3, 3, 0]), torch.tensor([True, True, True]), bonus)
    assert out.tokens == [[1, 2, 3, 4], [1, 2], [5]]
    assert out.num_accepted == [3, 1, 0]


def test_greedy_ignores_drafts_past_num_drafts():
    probs = torch.full((1, 2, 4), 0.1)
    probs[0, 0, 2] = probs[0, 1, 0] = 0.7
    out = verify(probs, torch.tensor([[2, 2]]), torch.tensor([1]), torch.tensor([True]), torch.tensor([1]))
    assert out.tokens == [[2, 1]] and out.num_accepted == [1]     # draft 2 accepted, then the bonus


def _random_case(n: int, k: int, v: int, gen: torch.Generator):
    p = torch.softmax(torch.randn(k + 1, v, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, v, generator=gen) * 1.5, dim=-1)
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(k)], dim=1)
    return p, q, drafts


def test_sampled_tokens_follow_the_target_distribution():
    gen = torch.Generator().manual_seed(1234)
    n, k, v = 40000, 2, 5
    p, q, drafts = _random_case(n, k, v, gen)
    bonus = torch.multinomial(p[k], n, replacement=True, generator=gen)
    out = verify(p[:k].expand(n, -1, -1), drafts, torch.full((n,), k), torch.zeros(n, dtype=torch.bool), bonus,
                 draft_probs=q.expand(n, -1, -1), generator=gen)
    first = torch.tensor([t[0] for t in out.tokens])
    assert _chi2(first, p[0]) < CHI2_DF4_P1E4
    # given that the first draft was accepted, the second emitted token follows p_2
    second = torch.tensor([t[1] for t, a in zip(out.tokens, out.num_accepted) if a >= 1])
    assert second.numel() > 5000
    assert _chi2(second, p[1]) < CHI2_DF4_P1E4
    assert all(len(t) == a + 1 for t, a in zip(out.tokens, out.num_accepted))


def test_one_hot_drafts_keep_the_target_distribution():
    """n-gram drafts are deterministic (q one-hot): accept with p(d), else sample p without d."""
    gen = torch.Generator().manual_seed(99)
    n, v = 40000, 5
    p = torch.softmax(torch.randn(2, v, generator=gen), dim=-1)
    drafts = torch.full((n, 1), 3)
    bonus = torch.multinomial(p[1], n, replacement=True, generator=gen)
    out = verify(p[:1].expand(n, -1, -1), drafts, torch.ones(n, dtype=torch.long), torch.zeros(n, dtype=torch.bool),
                 bonus, generator=gen)
    second = torch.tensor([t[1] for t, a in zip(out.tokens, out.num_accepted) if a == 1])
    assert _chi2(second, p[1]) < CHI2_DF4_P1E4
    first = torch.tensor([t[0] for t in out.tokens])
    assert _chi2(first, p[0]) < CHI2_DF4_P1E4


def test_a_wrong_rule_would_be_caught():
    """The statistic is far above the threshold for samples drawn from the drafter instead."""
    gen = torch.Generator().manual_seed(5)
    p, q, drafts = _random_case(40000, 1, 5, gen)
    assert _chi2(drafts[:, 0], p[0]) > 10 * CHI2_DF4_P1E4
