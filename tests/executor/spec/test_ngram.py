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


def test_among_equal_matches_the_one_whose_context_shares_most_wins():
    p = NgramProposer(1, 4)
    #          0   1   2  3   4   5   6  7   8   9  10  11
    history = [10, 11, 12, 5, 20, 30, 31, 5, 40, 11, 12, 5]
    # [12, 5] occurs once (at 2..3): a 2-gram beats the later 1-gram [5] at 7
    assert p.propose_one(history, 2) == [20, 30]
    #          0   1   2  3   4   5   6  7   8   9  10
    history = [10, 11, 12, 5, 20, 30, 31, 5, 40, 11, 5]
    # only [5] matches, at 3 and at 7; of the last 8 tokens [5, 20, 30, 31, 5, 40, 11, 5], 4 occur
    # in the 8 up to 3 (hist[0:4]) and 7 in the 8 up to 7: the latest, as before
    assert p.propose_one(history, 2) == [40, 11]
    history = [10, 11, 12, 5, 20, 1, 2, 3, 4, 6, 7, 30, 31, 5, 40, 8, 9, 10, 11, 12, 5]
    # [12, 5] again the longest; drop it and [5] matches at 3 and at 13: the context before 3
    # (10, 11, 12) is what the history just wrote, the one before 13 (7, 30, 31) is not
    assert p.propose_one(history[:-2] + [13, 5], 2) == [20, 1]
    # [9] at 8 and 18, each after 2..8: an equal context, the latest wins
    assert p.propose_one([1, 2, 3, 4, 5, 6, 7, 8, 9, 40, 1, 2, 3, 4, 5, 6, 7, 8, 9, 41, 9], 1) == [41]


def test_resync_drafts_past_a_replaced_token():
    history = [1, 2, 3, 4, 5, 6, 1, 2, 9]        # 9 is new: it replaced the 3 after [1, 2]
    assert NgramProposer(1, 4).propose_one(history, 3) == []
    assert NgramProposer(1, 4, resync=True).propose_one(history, 3) == [4, 5, 6]
    assert NgramProposer(3, 4, resync=True).propose_one(history, 3) == []     # [1, 2] is shorter than 3
    # an exact match, however short, comes first
    assert NgramProposer(1, 4, resync=True).propose_one(history + [1, 2, 6], 2) == [1, 2]


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
