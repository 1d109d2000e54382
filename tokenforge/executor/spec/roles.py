"""Rank roles with speculative decoding: after the ordinary sampling (which draws each drafted
sequence's bonus token from the distribution after its last draft), the logits at the draft
positions are taken too, and the driver verifies the drafts when it collects the step.

A sequence scheduled with d drafts holds n tokens: ..., t (its last known token), d_1..d_d. The
row of t predicts d_1, the row of d_j predicts d_{j+1}, and the last row (d_d's) predicts the bonus
token, which the base role samples as it samples any last row. Every first-stage rank computes
the draft rows' logits in the same order, after the base role's collectives (TP LM head).
"""

from __future__ import annotations

import torch

from tokenforge.executor.roles import Driver, StepInFlight, TPFollower
from tokenforge.executor.sampler import apply_min_p, apply_top_k_top_p
from tokenforge.executor.sampling_batch import SamplingBatch
from tokenforge.executor.spec.rejection import verify


def make_speculative_role(runner):
    return SpeculativeDriver(runner) if runner.rank.is_driver else SpeculativeFollower(runner)


def draft_logits(role, step: StepInFlight) -> None:
    """Queue the LM head over every drafted sequence's draft positions (rows of t, d_1..d_{d-1})."""
    seqs, index = [], []
    for i, s in enumerate(step.sched.sequences):
        d = s.num_draft_tokens
        if not (s.sample and d):
            continue
        end = step.inputs.query_start_loc[i + 1] - 1          # the last row: the bonus token's
        index.extend(range(end - d, end))
        seqs.append(s)
    if seqs:
        rows = torch.tensor(index, device=step.hidden.device)
        step.draft_logits = (seqs, role.model.compute_logits(step.hidden[rows]))


class SpeculativeFollower(TPFollower):
    def after_forward(self, step: StepInFlight, defer_sampling: bool) -> None:
        super().after_forward(step, defer_sampling)
        draft_logits(self, step)
        step.draft_logits = None      # rank 0 verifies; this rank only joined the collectives


class SpeculativeDriver(Driver):
    def after_forward(self, step: StepInFlight, defer_sampling: bool) -> None:
        if defer_sampling:
            raise RuntimeError("speculative decoding runs synchronous steps: nothing defers its sampling")
        super().after_forward(step, defer_sampling)
        draft_logits(self, step)

    def collect(self, step: StepInFlight, out) -> None:
        super().collect(step, out)
        if step.draft_logits is None:
            return
        seqs, logits = step.draft_logits
        step.draft_logits = None
        k = max(s.num_draft_tokens for s in seqs)
        vocab = logits.shape[-1]
        device = logits.device
        probs = torch.zeros(len(seqs), k, vocab, device=device)
        drafts = torch.zeros(len(seqs), k, dtype=torch.long)
        params, rows = [], 0
        for i, s in enumerate(seqs):
            d = s.num_draft_tokens
            drafts[i, :d] = torch.tensor(s.token_ids[-d:])
            params.extend([s.params] * d)
        flat = target_probs(logits, SamplingBatch.build(params, [[]] * len(params), [[]] * len(params),
                                                        [None] * len(params), self.vocab_size, device))
        for i, s in enumerate(seqs):
            d = s.num_draft_tokens
            probs[i, :d] = flat[rows:rows + d]
            rows += d
        bonus = torch.tensor([out.sampled_token_ids[s.request_id][-1] for s in seqs], device=device)
        result = verify(probs, drafts.to(device), torch.tensor([s.num_draft_tokens for s in seqs], device=device),
                        torch.tensor([s.params.is_greedy for s in seqs], device=device), bonus)
        for s, tokens in zip(seqs, result.tokens):
            out.sampled_token_ids[s.request_id] = tokens


def target_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distributions the sampler draws from (temperature, top-k, top-p, min-p), normalised."""
    logits = logits.float()
    if batch.all_greedy:
        return torch.softmax(logits, dim=-1)      # only the argmax is read
    logits = logits / batch.temperature
    if batch.top_k is not None or batch.top_p is not None:
        logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p, batch.max_top_k)
    probs = torch.softmax(logits, dim=-1)
    if batch.min_p is not None:
        probs = apply_min_p(probs, batch.min_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
