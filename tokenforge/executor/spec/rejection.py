"""Verification of draft tokens against the target model's distributions, on the device.

For request i with drafts d_1..d_k (k <= K), the target forward over the k+1 positions gives
distributions p_1..p_{k+1}. Greedy rows accept the longest prefix with d_j == argmax p_j and then
emit the argmax at the first mismatch (or argmax p_{k+1}, the bonus token, when all match), so the
output is token for token the non-speculative greedy output.

Sampled rows use the standard rule (Leviathan et al.; Chen et al.): accept d_j with probability
min(1, p_j(d_j) / q_j(d_j)), where q_j is the drafter's distribution (one-hot for deterministic
drafters such as n-gram lookup: q_j(d_j) = 1); at the first rejection sample from the residual
norm(max(0, p_j - q_j)); if every draft is accepted, emit the bonus token drawn from p_{k+1}. The
emitted tokens are then distributed exactly as the target's own samples.

Every drafter the runner has is deterministic (n-gram lookup, a draft model's or an EAGLE head's
argmax: q one-hot), and for one-hot drafts the rule takes a simpler, equivalent form, the one the
runner uses (spec/roles.py): sample x_j from p_j at every row and accept d_{j+1} while it equals x_j.
P(accept d) = p(d) = min(1, p(d) / 1), and given a rejection x is distributed as p without d,
renormalised: the residual norm(max(0, p - onehot(d))). The emitted tokens are x_0..x_a, each one
draw per row from the target's distribution: a seeded request drawing its rows from its own
generator emits exactly what it emits without speculation. With several candidates at a node (a
tree draft) the same form is the multi-candidate rule for one-hot drafts: follow the child whose
token is x, else emit x. `greedy_verify` is that comparison for both greedy and sampled rows;
`rejection_verify` is the general rule (any q), the reference the distribution tests hold.

Everything is batched over rows and positions and stays on the device: the results are two small
tensors (tokens [N, K+1], accepted counts [N]) the runner copies back with the step's other
results, so a verify step still syncs with the host once. `verify` is the list form (tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class VerifyOutput:
    tokens: list[list[int]]      # per row: the accepted drafts plus one corrected / bonus token
    num_accepted: list[int]      # per row: how many drafts were accepted (0..k)


def greedy_verify(target_ids: torch.Tensor, draft_tokens: torch.Tensor,
                  num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_ids [N, K+1]: the token the target emits at each verified position (its argmax, or
    its sample there); draft_tokens [N, K] (entries past num_drafts ignored); num_drafts [N]. Returns (tokens [N, K+1], num_accepted [N]): a row
    emits tokens[:num_accepted + 1], the accepted drafts (equal to the argmax) and the argmax after."""
    k_max = draft_tokens.shape[1]
    positions = torch.arange(k_max, device=draft_tokens.device)
    ok = (target_ids[:, :k_max] == draft_tokens) & (positions[None, :] < num_drafts[:, None])
    return target_ids, ok.to(torch.int64).cumprod(dim=1).sum(dim=1)


def rejection_verify(target_probs: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
                     greedy: torch.Tensor, bonus_tokens: torch.Tensor, draft_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [N, K, V]: the target's (processed) distributions at the K draft positions
    (rows past num_drafts ignored); draft_tokens [N, K] int64; num_drafts [N] int64; greedy [N]
    bool; bonus_tokens [N]: the token drawn from the distribution after the last draft, emitted
    when every draft is accepted; draft_probs [N, K, V] or None (one-hot drafts).
    Returns (tokens [N, K+1], num_accepted [N]) as `greedy_verify` does."""
    n, k_max = draft_tokens.shape
    device = target_probs.device
    positions = torch.arange(k_max, device=device)
    valid = positions[None, :] < num_drafts[:, None]                                   # [N, K]
    p_draft = target_probs.gather(2, draft_tokens[..., None]).squeeze(2)               # [N, K]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2)
    uniform = torch.rand(p_draft.shape, device=device, generator=generator, dtype=p_draft.dtype)
    sampled_ok = uniform * q_draft < p_draft                     # u < p/q without dividing by 0
    greedy_ok = target_probs.argmax(dim=2) == draft_tokens
    ok = torch.where(greedy[:, None], greedy_ok, sampled_ok) & valid
    num_accepted = ok.to(torch.int64).cumprod(dim=1).sum(dim=1)                       # [N]

    # at the first rejection (position a < num_drafts): the argmax, or a residual sample
    rows = torch.arange(n, device=device)
    a = num_accepted.clamp(max=k_max - 1)
    p_rej = target_probs[rows, a]                                                      # [N, V]
    if draft_probs is None:
        q_rej = torch.zeros_like(p_rej)
        q_rej.scatter_(1, draft_tokens[rows, a][:, None], 1.0)
    else:
        q_rej = draft_probs[rows, a]
    diff = (p_rej - q_rej).clamp_min(0)
    norm = diff.sum(dim=1, keepdim=True)
    # a residual of zero mass can only come from rounding (p == q): fall back to p itself
    residual = torch.where(norm > 0, diff / norm.clamp_min(torch.finfo(diff.dtype).tiny), p_rej)
    corrected = torch.where(greedy, p_rej.argmax(dim=1), sample(residual, generator))
    next_token = torch.where(num_accepted < num_drafts, corrected, bonus_tokens.to(corrected.dtype))
    tokens = torch.cat([draft_tokens, draft_tokens[:, :1]], dim=1).clone()            # [N, K+1]
    tokens.scatter_(1, num_accepted[:, None], next_token[:, None])
    return tokens, num_accepted


def verify(target_probs: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
           greedy: torch.Tensor, bonus_tokens: torch.Tensor, draft_probs: torch.Tensor | None = None,
           generator: torch.Generator | None = None) -> VerifyOutput:
    """`rejection_verify` as lists (one host read)."""
    tokens, accepted = rejection_verify(target_probs, draft_tokens, num_drafts, greedy, bonus_tokens,
                                        draft_probs, generator)
    return to_lists(tokens, accepted)


def to_lists(tokens: torch.Tensor, num_accepted: torch.Tensor) -> VerifyOutput:
    accepted = num_accepted.tolist()
    return VerifyOutput([t[:a + 1] for t, a in zip(tokens.tolist(), accepted)], accepted)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row by the exponential race (no host sync, as the main sampler does)."""
    q = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / q).argmax(dim=1)
