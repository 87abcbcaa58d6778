"""The n-gram proposer (prompt lookup) and its per-sequence backoff."""

from __future__ import annotations

from ingot.engine.ngram import BACKOFF_MIN, NgramIndex, SpecState


def index(tokens: list[int], lo: int, hi: int) -> NgramIndex:
    ix = NgramIndex(lo, hi)
    ix.extend(tokens[:3])
    ix.extend(tokens[3:])  # built incrementally, as a sequence grows
    return ix


def test_the_longest_suffix_match_proposes_what_followed():
    # suffix [7, 8, 9] occurs at 4..6 (followed by 1, 2); [8, 9] alone also at 0..1 (followed by 5)
    tokens = [8, 9, 5, 0, 7, 8, 9, 1, 2, 3, 7, 8, 9]
    assert index(tokens, 1, 3).propose(2) == [1, 2]
    assert index(tokens, 1, 3).propose(5) == [1, 2, 3, 7, 8]
    assert index(tokens, 1, 2).propose(2) == [5, 0]  # the earliest occurrence of the longest allowed suffix


def test_no_match_or_too_short_proposes_nothing():
    assert index([1, 2, 3, 4, 5], 1, 4).propose(3) == []
    assert index([1, 2, 1, 2], 3, 3).propose(3) == []  # [2, 1, 2] never occurred before
    assert index([4], 1, 2).propose(3) == []
    assert index([1, 2, 1, 2], 1, 2).propose(0) == []


def test_a_match_needs_a_follower_and_proposals_stop_at_the_end():
    assert index([5, 5], 1, 1).propose(4) == [5]  # the only earlier 5 is followed by the last token
    assert index([3, 4, 3, 4, 3], 1, 3).propose(4) == [4, 3]  # [3, 4, 3] at 0..2: two tokens follow it


def test_one_token_at_a_time_equals_all_at_once():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    grown = NgramIndex(1, 3)
    for i, t in enumerate(tokens):
        grown.extend([t])
        assert grown.propose(3) == index(tokens[: i + 1], 1, 3).propose(3)
    assert grown.propose(3) == [9, 2, 6]  # neither [7, 9, 5] nor [9, 5] occurred before; 5 first at 4


def test_backoff_after_poor_drafts_and_misses():
    st = SpecState(True, 1, 2)
    st.record(4, 4)
    assert st.skip == 0 and st.num_drafts == 1 and st.num_accepted_tokens == 4
    st.record(4, 0)
    st.record(0, 0)  # a lookup that found nothing
    st.record(4, 0)
    assert st.skip == BACKOFF_MIN and st.backoff == 2 * BACKOFF_MIN
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (3, 12, 4)
