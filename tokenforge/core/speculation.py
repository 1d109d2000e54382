"""The scheduler's half of speculative decoding: which requests get drafts, how many, and the
rollback of rejected drafts' KV after verification.

A `DraftPlanner` is made once at start-up when a speculative method is set (else the scheduler
holds None and pays nothing). Its proposer is a plain callable (history, k) -> draft ids, injected
by the engine (core imports no torch or numpy). A request decoding its last known token gets up
to K drafts, capped by its remaining max_tokens, the length cap and the step's token budget; it
is then scheduled as 1 + d tokens and verified by the runner in one forward.

Not drafted (they decode one token a step as before): requests whose sampling reads their own
history within a step (penalties), that want logprobs or grammar masks, that are before
min_tokens (banned ids per position), or sampled ones with a seed (their generator's stream);
the verifier would need per-position state for those.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenforge.core.request import Request
from tokenforge.messages import SpecDecodeStats

Proposer = Callable[[list[int], int], list[int]]


class DraftPlanner:
    def __init__(self, proposer: Proposer, num_draft_tokens: int) -> None:
        self.proposer = proposer
        self.k = num_draft_tokens
        self.reset_counters()

    def reset_counters(self) -> None:
        """Totals, for metrics (vLLM's spec_decode counters); the bench resets them after a warm-up."""
        self.num_drafted = 0
        self.num_accepted = 0
        self.num_verify_steps = 0       # sequences verified with at least one draft
        self.accepted_per_position = [0] * self.k

    @staticmethod
    def eligible(req: Request) -> bool:
        p = req.params
        return (not req.needs_sync and p.logprobs is None and p.grammar is None
                and req.num_output_tokens >= p.min_tokens and (p.seed is None or p.is_greedy))

    def drafts(self, req: Request, budget: int, max_len: int) -> list[int]:
        """Draft tokens for a request about to decode its last token (possibly none)."""
        if req.num_output_placeholders or req.num_computed_tokens != req.num_tokens - 1:
            return []
        room = min(self.k, budget - 1, req.params.max_tokens - req.num_output_tokens - 1,
                   max_len - req.num_tokens - 1)
        if room <= 0 or not self.eligible(req):
            return []
        return self.proposer(req.all_token_ids, room)[:room]

    def after_verify(self, req: Request, num_drafts: int, num_new_tokens: int) -> None:
        """Roll the request back to the tokens whose KV is valid: every token but the last one
        emitted (rejected drafts' slots are recomputed or freed)."""
        accepted = min(num_drafts, max(0, num_new_tokens - 1))
        self.num_drafted += num_drafts
        self.num_accepted += accepted
        self.num_verify_steps += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_verify_steps, self.num_drafted, self.num_accepted,
                               list(self.accepted_per_position))

    def stats(self) -> dict[str, float]:
        steps = self.num_verify_steps
        return {"num_drafts": steps, "num_draft_tokens": self.num_drafted,
                "num_accepted_tokens": self.num_accepted,
                "acceptance_rate": self.num_accepted / self.num_drafted if self.num_drafted else 0.0,
                "mean_acceptance_length": 1 + self.num_accepted / steps if steps else 0.0,
                "accepted_per_position": list(self.accepted_per_position)}
