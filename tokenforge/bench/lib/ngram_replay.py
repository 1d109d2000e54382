"""Offline replay of an n-gram proposer over saved greedy answers (`tokenforge bench spec-replay`).

Greedy output does not depend on speculation, so what a proposer would have drafted and what the
target would have accepted can be computed from the answer alone, without the device: after the
prefill's first token, each verify step proposes up to K drafts from the history (prompt + the
answer so far), accepts the longest prefix equal to the answer's next tokens and emits it plus one.
In: `Continuation`s (prompt ids, answer ids) and a proposer `(history, k) -> drafts`. Out: tokens
per verify step and the steps' modelled cost against one decode a token. Two cost models:
  burst: every iteration runs its K + 1 rows, drafted or not (executor/spec/burst.py, batch 1 on
         CUDA graphs): a step costs c(K);
  host:  a step that drafted nothing is a plain decode (1), one that drafted costs c(K).
c(K) is a verify of K + 1 rows over a one-row decode, linear between the measured points.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# a verify of K + 1 rows against a one-row decode, bundled model, H100, CUDA graphs (bench/NOTES.md)
MEASURED_COSTS = {4: 1.25, 16: 1.8}


@dataclass(slots=True)
class Continuation:
    prompt: list[int]
    output: list[int]


@dataclass(slots=True)
class ReplayStats:
    decodes: int = 0        # decode steps without speculation (the answer's tokens after the first)
    steps: int = 0          # verify steps
    empty: int = 0          # of which drafted nothing
    tokens: int = 0         # tokens the verify steps emitted (= decodes)

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / max(1, self.steps)

    def speedup(self, cost: float, burst: bool) -> float:
        """Decodes saved: decode steps without speculation over the steps' modelled cost."""
        spent = self.steps * cost if burst else (self.steps - self.empty) * cost + self.empty
        return self.decodes / max(spent, 1e-9)


def verify_cost(k: int, costs: dict[int, float] = MEASURED_COSTS) -> float:
    """c(k): the measured cost at k, else linear through the two nearest measured points."""
    if k in costs:
        return costs[k]
    points = sorted(costs)
    lo = max([p for p in points if p < k], default=points[0])
    hi = min([p for p in points if p > k], default=points[-1])
    if lo == hi:
        lo, hi = points[0], points[-1]
    return costs[lo] + (k - lo) * (costs[hi] - costs[lo]) / (hi - lo)


def replay(conts: list[Continuation], propose, k: int) -> ReplayStats:
    stats = ReplayStats()
    for c in conts:
        history, n = list(c.prompt) + list(c.output), len(c.output)
        stats.decodes += max(0, n - 1)
        i = 1                       # the prefill emitted output[0]
        while i < n:
            at = len(c.prompt) + i
            drafts = list(propose(history[:at], k))[:k]
            accepted = 0
            for j, d in enumerate(drafts[:n - i - 1]):      # the last token is a bonus, never a draft
                if d != history[at + j]:
                    break
                accepted = j + 1
            stats.steps += 1
            stats.empty += not drafts
            stats.tokens += accepted + 1
            i += accepted + 1
    return stats


def latest_match(ngram_min: int, ngram_max: int):
    """The rule before the context tie-break (kept to compare against): the tokens after the latest
    earlier occurrence of the longest suffix of n = ngram_max..ngram_min tokens."""
    def propose(history: list[int], k: int) -> list[int]:
        tokens = np.asarray(history, dtype=np.int64)
        length = tokens.shape[0]
        for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []
    return propose
