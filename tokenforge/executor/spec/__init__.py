"""Speculative decoding: proposers draft up to K tokens per request, one target forward verifies
K+1 positions, and `rejection.verify` decides what is emitted (exact under greedy and sampling).

A proposer is chosen once at start-up (`--speculative-method`); the runner calls `propose` with
each decoding request's token history and gets back draft lists (possibly empty: a request with
no draft decodes one token as usual).
"""

from __future__ import annotations

from typing import Protocol


class Proposer(Protocol):
    def propose(self, histories: list[list[int]], k: int) -> list[list[int]]:
        """Up to `k` draft tokens for each history (prompt + output so far), possibly none."""
        ...
