"""The n-gram proposer (prompt lookup) and its per-sequence backoff."""

from __future__ import annotations

from ingot.engine.ngram import BACKOFF_MIN, NgramIndex, SpecState


def index(tokens: list[int]) -> NgramIndex:
    ix = NgramIndex()
    ix.extend(tokens[:3])
    ix.extend(tokens[3:])  # built incrementally, as a sequence grows
    return ix


def test_the_longest_suffix_match_proposes_what_followed():
    # suffix [7, 8, 9] occurs at 4..6 (followed by 1, 2); [8, 9] alone also at 0..1 (followed by 5)
    tokens = [8, 9, 5, 0, 7, 8, 9, 1, 2, 3, 7, 8, 9]
    assert index(tokens).propose(2, 1, 3) == [1, 2]
    assert index(tokens).propose(5, 1, 3) == [1, 2, 3, 7, 8]
    assert index(tokens).propose(2, 1, 2) == [5, 0]  # the earliest occurrence of the longest allowed suffix


def test_no_match_or_too_short_proposes_nothing():
    assert index([1, 2, 3, 4, 5]).propose(3, 1, 4) == []
    assert index([1, 2, 1, 2]).propose(3, 3, 3) == []  # [2, 1, 2] never occurred before
    assert index([4]).propose(3, 1, 2) == []
    assert index([1, 2, 1, 2]).propose(0, 1, 2) == []


def test_a_match_needs_a_follower_and_proposals_stop_at_the_end():
    assert index([5, 5]).propose(4, 1, 1) == [5]  # the only earlier 5 is followed by the last token
    assert index([3, 4, 3, 4, 3]).propose(4, 1, 3) == [4, 3]  # [3, 4, 3] at 0..2: two tokens follow it


def test_byte_matches_across_token_boundaries_are_skipped():
    # 256 = bytes 00 01 00 00, 1 = 01 00 00 00: [256, 1]'s bytes hold [1]'s pattern at a misaligned offset
    ix = index([256, 0, 9, 1])
    assert ix.propose(2, 1, 1) == []


def test_backoff_after_poor_drafts_and_misses():
    st = SpecState(True)
    st.record(4, 4)
    assert st.skip == 0 and st.num_drafts == 1 and st.num_accepted_tokens == 4
    st.record(4, 0)
    st.record(0, 0)  # a lookup that found nothing
    st.record(4, 0)
    assert st.skip == BACKOFF_MIN and st.backoff == 2 * BACKOFF_MIN
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (3, 12, 4)
