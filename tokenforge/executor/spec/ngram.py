"""N-gram prompt lookup: draft the tokens that followed the latest earlier occurrence of the
request's last n tokens, trying n = ngram_max down to ngram_min. No second model; it pays off on
input-grounded work (rewriting, summarising, code editing) where the output quotes the input.

The search is one vectorised comparison per n over the whole history (numpy), so a step costs
O(len * n) per request without a Python loop over positions.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, ngram_min: int = 1, ngram_max: int = 4) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min} and {ngram_max}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, histories: list[list[int]], k: int) -> list[list[int]]:
        return [self.propose_one(h, k) for h in histories]

    def propose_one(self, history: list[int] | np.ndarray, k: int) -> list[int]:
        tokens = np.asarray(history, dtype=np.int64)
        length = tokens.shape[0]
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            # candidate starts s (s + n <= length - 1, so at least one token follows the match
            # and the match is not the suffix itself)
            windows = sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n           # the latest occurrence: the most local context
                return tokens[start:start + k].tolist()
        return []
