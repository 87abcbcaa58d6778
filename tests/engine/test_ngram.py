"""The n-gram proposer (prompt lookup) and its per-sequence backoff."""

from __future__ import annotations

from ingot.engine.ngram import BACKOFF_MAX, BACKOFF_MIN, DRAFT_BACKOFF_MAX, NgramIndex, SpecState


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
    st.record(4, 4)  # rate 1.0
    assert st.skip == 0 and st.num_drafts == 1 and st.num_accepted_tokens == 4
    st.record(4, 0)  # 0.5
    st.record(0, 0)  # a lookup that found nothing: 0.25, not below LOW_ACCEPTANCE
    assert st.skip == 0
    st.record(4, 0)  # 0.125: pause
    assert st.skip == BACKOFF_MIN and st.backoff == 2 * BACKOFF_MIN
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (3, 12, 4)
    st.skip = 0
    st.record(4, 1)  # after the pause (rate 0.375) a draft keeping a quarter goes on: 0.3125
    assert st.skip == 0
    st.record(4, 0)  # 0.15625: paused again, twice as long
    assert st.skip == 2 * BACKOFF_MIN and st.backoff == 4 * BACKOFF_MIN
    st.skip = 0
    st.record(0, 0)  # right after a pause, one more failure is enough: 0.1875
    assert st.skip == 4 * BACKOFF_MIN
    st.skip = 0
    st.record(4, 3)  # a mostly kept draft: the pause back to its least
    assert st.backoff == BACKOFF_MIN


def attempts_when_nothing_is_kept(backoff_max: int, steps: int) -> list[int]:
    """The steps at which a sequence drafts when none of its drafts is ever kept (one
    step per propose call: a paused one counts its pause down, as ``Speculator.propose``)."""
    st, attempts = SpecState(True, 1, 2, backoff_max), []
    for step in range(steps):
        if st.skip:
            st.skip -= 1
            continue
        attempts.append(step)
        st.record(4, 0)
    return attempts


def test_a_useless_draft_model_pauses_longer_than_a_lookup():
    """Rate 0.5, 0.25, then 0.125 (paused 4), then after each pause one more failed attempt
    (rate 0.375 -> 0.1875), the pause doubling to its cap: 32 for lookups, 256 for a draft
    model, whose attempt costs several steps (ngram.py)."""
    assert BACKOFF_MAX == 32 and DRAFT_BACKOFF_MAX == 256
    assert attempts_when_nothing_is_kept(BACKOFF_MAX, 256) == [0, 1, 2, 7, 16, 33, 66, 99, 132, 165, 198, 231]
    assert attempts_when_nothing_is_kept(DRAFT_BACKOFF_MAX, 256) == [0, 1, 2, 7, 16, 33, 66, 131]
    assert attempts_when_nothing_is_kept(DRAFT_BACKOFF_MAX, 1024)[-3:] == [260, 517, 774]


def test_may_follow_only_where_the_tokens_before_the_next_occurred_earlier():
    """A lookup after one more token t searches suffixes ending (..., last, t): with
    lookup_min 2 it can only succeed where ``last`` occurred before the end (followed by
    something); with lookup_min 3 where the last two did; with lookup_min 1 always."""
    assert index([5, 6, 7, 6], 2, 4).may_follow()  # 6 occurred at 1 (followed by 7)
    assert not index([5, 6, 7, 8], 2, 4).may_follow()  # 8 never occurred before
    assert not index([5, 6, 7, 6], 3, 4).may_follow()  # [7, 6] never occurred before
    assert index([7, 6, 1, 7, 6], 3, 4).may_follow()
    assert index([5, 6, 7, 8], 1, 4).may_follow()
    for tokens in ([5, 6, 7, 6, 9], [5, 6, 7, 8, 9], [7, 6, 1, 7, 6, 6], [3, 3, 3]):  # agrees with a lookup
        for lo in (2, 3):
            before = index(tokens[:-1], lo, 4)
            assert before.may_follow() or not index(tokens, lo, 4).propose(2)


def test_a_pending_token_is_read_back_only_when_a_lookup_can_succeed():
    """With the step in flight not read back (overlap scheduling), the speculator wants the
    read-back only where the tokens before the pending one occurred earlier; a draft model
    always proposes."""
    from ingot.config import SpeculativeConfig
    from ingot.engine.sequence import Sequence, Status
    from ingot.engine.speculative import DraftModelSpeculator, Speculator
    from ingot.sampling_params import SamplingParams

    def pending_seq(prompt: list[int], known: list[int]) -> Sequence:
        seq = Sequence("r", None, prompt, SamplingParams(max_tokens=100), None)  # type: ignore[arg-type]
        seq.status, seq.output_token_ids, seq.num_pending = Status.RUNNING, known, 1
        seq.num_computed_tokens = seq.num_tokens - 1
        return seq

    config = SpeculativeConfig("ngram", 4, 2, 4)
    assert Speculator(config, 1000).wanted([pending_seq([1, 2, 3, 4], [2])])  # 2 occurred in the prompt
    assert not Speculator(config, 1000).wanted([pending_seq([1, 2, 3, 4], [9])])
    assert Speculator(config, 1000).wanted([pending_seq([1, 2, 3, 4], [9]), pending_seq([1, 2, 3, 4], [3])])
    seq = pending_seq([1, 2, 3, 4], [9])
    seq.num_pending = 0  # nothing in flight: the lookup itself decides
    assert Speculator(config, 1000).wanted([seq])
    draft = SpeculativeConfig.from_dict({"model": "draft", "num_speculative_tokens": 4})
    assert DraftModelSpeculator(draft, 1000).wanted([pending_seq([1, 2, 3, 4], [9])])
    # each sequence's pause is capped by its speculator: a draft model's attempts cost more
    assert DraftModelSpeculator(draft, 1000)._state(pending_seq([1, 2], [3])).backoff_max == DRAFT_BACKOFF_MAX
    assert Speculator(config, 1000)._state(pending_seq([1, 2], [3])).backoff_max == BACKOFF_MAX
