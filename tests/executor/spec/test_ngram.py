from __future__ import annotations

import pytest

from tokenforge.executor.spec.ngram import NgramProposer


def test_proposes_what_followed_the_latest_match_of_the_longest_ngram():
    p = NgramProposer(1, 3)
    #            0  1  2  3  4  5  6  7  8  9
    history = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # suffix (2? no) 3-gram [2,6,7] never occurred before; 2-gram [6,7] latest at 6 -> follows 2
    assert p.propose_one(history, 3) == [2, 6, 7]
    assert NgramProposer(3, 3).propose_one(history, 3) == []
    # a 3-gram match wins over a later 2-gram match
    history = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    assert p.propose_one(history, 2) == [4, 9]


def test_k_caps_the_draft_and_the_end_of_history_cuts_it():
    p = NgramProposer(1, 2)
    assert p.propose_one([4, 5, 6, 4, 5], 10) == [6, 4, 5]
    assert p.propose_one([4, 5, 6, 4, 5], 1) == [6]
    assert p.propose([[1], [], [3, 3]], 4) == [[], [], [3]]


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="ngram_min <= ngram_max"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match="1 <= ngram_min"):
        NgramProposer(0, 2)
