"""N-gram prompt lookup, the proposer of speculative decoding, and each sequence's state for it.

A sequence's draft is what followed the longest recent suffix of its own tokens (prompt and
output) where it occurred before: text that repeats (code edits, quoting, lists, summaries
of the prompt) is drafted for free and verified in one forward (``engine/speculative.py``).
The index is kept up to date incrementally: a suffix that never occurred is one dict lookup,
and one that did a few ``bytearray.find`` calls, microseconds per sequence at 4k-token
contexts (``python -m benchmarks.ngram_proposer``).
"""

from __future__ import annotations

import array

# Per-sequence backoff: an exponential average of the fraction of drafts accepted (a lookup
# that found nothing counts as 0); below LOW_ACCEPTANCE the sequence sits out BACKOFF_MIN
# steps, doubling up to its speculator's cap while it stays low (after a pause one more draft
# of which nothing is kept pauses it again), back to BACKOFF_MIN once a draft is mostly
# accepted. The cap: BACKOFF_MAX where a failed attempt costs about a step (an n-gram lookup
# and its verify rows), DRAFT_BACKOFF_MAX for a draft model, whose attempt costs its k draft
# steps, the verify step and its catch-up (H100, 7B shape drafted by the 1.5B shape, k=4: about
# 28 ms against a 5.2 ms step; with the cap at 32, drafts that were never kept cost 27% of a
# 256-token request's output rate, 84 attempts in 1,020 steps, 1.92 s more a round; at 256, 8
# attempts a request).
LOW_ACCEPTANCE = 0.25
BACKOFF_MIN = 4
BACKOFF_MAX = 32
DRAFT_BACKOFF_MAX = 256

# Token ids are stored multiplied by an odd constant (mod 2**32, a bijection): small ids have
# zero high bytes, which defeat ``find``'s skip table; mixed bytes let it skip ahead (3-8x faster).
_U32 = 0xFFFFFFFF
_MIX = 0x9E3779B1
_UNMIX = pow(_MIX, -1, 1 << 32)


class NgramIndex:
    """A sequence's tokens as (mixed) uint32 bytes, appended as they come, and the first
    position each ``lookup_min``-gram ends at: a suffix that never occurred costs one dict
    lookup; longer suffixes are ``bytearray.find`` calls (C speed) from that first
    occurrence on, never a Python loop over the context."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max
        self.buf = bytearray()
        self.num_tokens = 0
        self.first_end: dict[bytes, int] = {}  # lookup_min-gram (its bytes) -> where it first ends

    def extend(self, tokens: list[int]) -> None:
        start = self.num_tokens
        self.buf += array.array("I", [(t * _MIX) & _U32 for t in tokens]).tobytes()
        self.num_tokens += len(tokens)
        n, buf, first = self.lookup_min, self.buf, self.first_end
        for end in range(max(start, n - 1), self.num_tokens):
            first.setdefault(bytes(buf[4 * (end - n + 1) : 4 * (end + 1)]), end)

    def propose(self, k: int) -> list[int]:
        """The ``k`` tokens (fewer at the end) that followed the earliest earlier occurrence
        of the longest suffix of ``lookup_min .. lookup_max`` tokens; [] when none occurred."""
        n_tok, lo = self.num_tokens, self.lookup_min
        if n_tok <= lo or k < 1:
            return []
        first = self.first_end.get(bytes(self.buf[4 * (n_tok - lo) :]), n_tok - 1)
        if first >= n_tok - 1:  # the suffix's only occurrence is itself: no longer one either
            return []
        end = first + 1
        for n in range(min(self.lookup_max, n_tok - 1), lo, -1):
            # an occurrence of a longer suffix ends with one of the shortest: not before ``first``
            longer = self._find(n, max(0, first - n + 1))
            if longer >= 0:
                end = longer
                break
        mixed = memoryview(self.buf)[4 * end : 4 * min(end + k, n_tok)].cast("I").tolist()
        return [(m * _UNMIX) & _U32 for m in mixed]

    def may_follow(self) -> bool:
        """Can a lookup after one more token find anything? Only where the last
        ``lookup_min - 1`` tokens occurred before (followed by some token): every suffix a
        lookup searches ends with them and the token to come. Lets a step with that token
        still on the device skip reading it back for a lookup that cannot succeed."""
        n = self.lookup_min - 1
        return self.num_tokens > 0 if n == 0 else self._find(n, 0) >= 0

    def _find(self, n: int, start: int) -> int:
        """Index of the token after the earliest occurrence of the last ``n`` tokens that
        starts at token ``start`` or later and ends before the last token; -1 if none."""
        buf, n_tok = self.buf, self.num_tokens
        needle = bytes(buf[4 * (n_tok - n) :])
        limit = 4 * (n_tok - 1)
        i = buf.find(needle, 4 * start, limit)
        while i > 0 and i % 4:  # a match across token boundaries: look further
            i = buf.find(needle, i + 1, limit)
        return -1 if i < 0 else i // 4 + n


class SpecState:
    """One sequence's proposer index, backoff and acceptance counts."""

    def __init__(self, allowed: bool, lookup_min: int, lookup_max: int, backoff_max: int = BACKOFF_MAX) -> None:
        self.allowed = allowed  # its sampling parameters permit speculation
        self.backoff_max = backoff_max
        self.index = NgramIndex(lookup_min, lookup_max)
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
            self.backoff = min(2 * self.backoff, self.backoff_max)
            # between LOW and 2 LOW: one more draft of nothing kept pauses it again, one of an
            # eighth kept or more does not
            self.rate = 1.5 * LOW_ACCEPTANCE
        elif frac >= 0.5:
            self.backoff = BACKOFF_MIN
