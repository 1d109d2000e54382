"""N-gram prompt lookup: draft the tokens that followed an earlier occurrence of the request's last
n tokens. No second model; it pays off on input-grounded work (rewriting, summarising, code
editing) where the output quotes the input.

The rule, for a history h of `length` tokens: every earlier position c (c <= length - 2) is a
candidate source for the last token, and the draft is what followed it, h[c + 1:c + 1 + k].
  1. exact: the longest n in ngram_max..ngram_min such that h[c - n + 1:c + 1] equals the last n
     tokens;
  2. (resync) if no candidate has even ngram_min: the last token replaced h[c] (the output changed
     one word of what it copies): the longest n such that h[c - n:c] equals the n tokens before
     the last;
  3. among the candidates of the longest n, the one whose CONTEXT tokens before it share the most
     of the history's last CONTEXT tokens (a bag count: each of the history's tokens that occurs
     there), then the latest.
Why 2 and 3: on a rewrite the output copies its input with small edits, and after an edit the
match is one token long (a comma, "the") with many candidates; the latest of them is usually in the
output itself, the wrong place. The wider context picks the occurrence where the copy was going,
and the replaced-token rule re-synchronises after a changed word instead of proposing nothing.
Rule 2 is for n-gram bursts only (executor/spec/burst.py), whose K + 1 rows run drafted or not; a
host verify step costs its rows only when something is drafted, and there rule 2's guesses (right
less often than an exact match) cost more than they bring.
Offline replay over SmolLM2's greedy answers (`tokenforge bench spec-replay`, bench/NOTES.md), a
burst's tokens per verify step at K = 16 against the latest match alone: grounded 3.65 -> 3.96
(+8.5%), held-out passages 4.48 -> 4.79 (+6.9%), chat 1.31 -> 1.34; the host rule (ngram_min 2,
no rule 2) gains ~1%.

Each step is a vectorised pass over the history (numpy), O(length * (n + CONTEXT^2)), with no
Python loop over positions. kernels/spec_burst.py `ngram_propose` is the same rule on the device.
"""

from __future__ import annotations

import numpy as np

CONTEXT = 8         # history tokens the tie-break compares (rule 3; kernels/spec_burst.py has the same)


def match_runs(tokens: np.ndarray, end: int, sources: np.ndarray, cap: int) -> np.ndarray:
    """Per source s: how many tokens, up to `cap`, of tokens[..end] equal tokens[..s], backwards."""
    runs = np.zeros(sources.shape[0], dtype=np.int64)
    alive = np.ones(sources.shape[0], dtype=bool)
    for t in range(min(cap, end + 1)):
        src = sources - t
        alive &= (src >= 0) & (tokens[np.maximum(src, 0)] == tokens[end - t])
        runs += alive
    return runs


def context_overlap(tokens: np.ndarray, length: int, sources: np.ndarray) -> np.ndarray:
    """Per source c: how many of the history's last CONTEXT tokens occur among tokens[c - CONTEXT + 1:c + 1]."""
    back = sources[None, :] - np.arange(CONTEXT)[:, None]                 # [CONTEXT, candidates]
    window = np.where(back >= 0, tokens[np.maximum(back, 0)], -1)
    tail = tokens[max(0, length - CONTEXT):length]                        # [<= CONTEXT]
    return (window[None, :, :] == tail[:, None, None]).any(axis=1).sum(axis=0)


class NgramProposer:
    def __init__(self, ngram_min: int = 1, ngram_max: int = 4, resync: bool = False) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min} and {ngram_max}")
        self.ngram_min, self.ngram_max, self.resync = ngram_min, ngram_max, resync

    def propose(self, histories: list[list[int]], k: int) -> list[list[int]]:
        return [self.propose_one(h, k) for h in histories]

    def propose_one(self, history: list[int] | np.ndarray, k: int) -> list[int]:
        tokens = np.asarray(history, dtype=np.int64)
        length = tokens.shape[0]
        if length < 2:
            return []
        sources = np.arange(length - 1)                    # c: a token follows it, and c < length - 1
        runs = match_runs(tokens, length - 1, sources, self.ngram_max)
        if runs.max() < self.ngram_min and self.resync:    # rule 2: the last token replaced h[c]
            runs = match_runs(tokens, length - 2, sources - 1, self.ngram_max)
        if runs.max() < self.ngram_min:
            return []
        best = sources[runs == runs.max()]                # the candidates of the longest match
        score = context_overlap(tokens, length, best) * length + best
        start = int(best[score.argmax()]) + 1
        return tokens[start:start + k].tolist()
