"""N-gram prompt lookup, the proposer of speculative decoding, and each sequence's state for it.

A sequence's draft is what followed the longest recent suffix of its own tokens (prompt and
output) where it occurred before: text that repeats (code edits, quoting, lists, summaries
of the prompt) is drafted for free and verified in one forward (``engine/speculative.py``).
The lookup is a few ``bytearray.find`` calls over the tokens as int32 bytes, kept up to date
incrementally, so its host cost stays in microseconds per sequence at 4k-token contexts.
"""

from __future__ import annotations

import array

# Per-sequence backoff: an exponential average of the fraction of drafts accepted (a lookup
# that found nothing counts as 0); below LOW_ACCEPTANCE the sequence sits out BACKOFF_MIN
# steps, doubling up to BACKOFF_MAX while it stays low, back to BACKOFF_MIN once a draft
# is mostly accepted.
LOW_ACCEPTANCE = 0.25
BACKOFF_MIN = 4
BACKOFF_MAX = 32


class NgramIndex:
    """A sequence's tokens as little-endian int32 bytes, appended as they come, so a lookup
    is a few ``bytearray.find`` calls (C speed) instead of a Python loop over the context."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.num_tokens = 0

    def extend(self, tokens: list[int]) -> None:
        self.buf += array.array("i", tokens).tobytes()
        self.num_tokens += len(tokens)

    def propose(self, k: int, lookup_min: int, lookup_max: int) -> list[int]:
        """The ``k`` tokens (fewer at the end) that followed the earliest earlier occurrence
        of the longest suffix of ``lookup_min .. lookup_max`` tokens; [] when none occurred."""
        n_tok = self.num_tokens
        lookup_max = min(lookup_max, n_tok - 1)
        if lookup_max < lookup_min or k < 1:
            return []
        end = self._find(lookup_min)  # no occurrence of the shortest suffix: none of a longer one
        if end < 0:
            return []
        for n in range(lookup_max, lookup_min, -1):
            longer = self._find(n)
            if longer >= 0:
                end = longer
                break
        follow = memoryview(self.buf)[4 * end : 4 * min(end + k, n_tok)].cast("i").tolist()
        return follow

    def _find(self, n: int) -> int:
        """Index of the token after the earliest occurrence of the last ``n`` tokens that ends
        before the last token (it has a follower); -1 if none."""
        buf, n_tok = self.buf, self.num_tokens
        needle = bytes(buf[4 * (n_tok - n) :])
        limit = 4 * (n_tok - 1)
        i = buf.find(needle, 0, limit)
        while i > 0 and i % 4:  # a match across token boundaries: look further
            i = buf.find(needle, i + 1, limit)
        return -1 if i < 0 else i // 4 + n


class SpecState:
    """One sequence's proposer index, backoff and acceptance counts."""

    def __init__(self, allowed: bool) -> None:
        self.allowed = allowed  # its sampling parameters permit speculation
        self.index = NgramIndex()
        self.rate = 1.0  # exponential average of the accepted fraction of its drafts
        self.skip = 0  # steps left without proposing
        self.backoff = BACKOFF_MIN
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def record(self, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens (0: the lookup found nothing) kept ``accepted``."""
        if drafted:
            self.num_drafts += 1
            self.num_draft_tokens += drafted
            self.num_accepted_tokens += accepted
        frac = accepted / drafted if drafted else 0.0
        self.rate = 0.5 * self.rate + 0.5 * frac
        if self.rate < LOW_ACCEPTANCE:
            self.skip = self.backoff
            self.backoff = min(2 * self.backoff, BACKOFF_MAX)
            self.rate = 2 * LOW_ACCEPTANCE  # one more poor draft after the pause backs off again
        elif frac >= 0.5:
            self.backoff = BACKOFF_MIN
