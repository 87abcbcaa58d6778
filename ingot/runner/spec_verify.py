"""Speculative decoding's verification: which drafted tokens each sequence keeps.

A verify step feeds each sequence its last token and its ``k`` drafted tokens (``k``
may be 0) and computes logits at all ``k + 1`` positions. Position ``j`` is the target
model's distribution ``p_j`` for the token after draft ``j - 1``. Per row:

* greedy: draft ``j`` is accepted while it equals ``argmax p_j``; the first mismatch
  emits the argmax instead (the correction), and a row that keeps all ``k`` drafts
  emits ``argmax p_k`` (the bonus token). The output is plain greedy decoding's.
* sampling: draft ``x_j`` was drawn from a draft distribution ``q_j``; rejection sampling
  accepts it with probability ``min(1, p_j(x_j) / q_j(x_j))`` and on rejection samples the
  residual ``max(p_j - q_j, 0)``, renormalised: the emitted token is distributed as ``p_j``,
  the distribution of plain sampling. The n-gram proposer is deterministic, its ``q_j`` a
  point mass on ``x_j``: ``x_j`` is kept with probability ``p_j(x_j)``, the residual is
  ``p_j`` without ``x_j``. A draft model samples its drafts for sampled requests from its
  own distribution under the request's parameters (``sample_drafts``), which keeps more of
  them. After ``k`` acceptances the bonus token is sampled from ``p_k``.

``p_j`` is what the sampler samples from (``Sampler.process_logits`` then
``Sampler.probs``, renormalised: token rules, ``min_tokens``, penalties, temperature, top-k /
top-p / min-p). Rows that speculate have neither penalties nor an active ``min_tokens`` (the
engine does not propose for them: both depend on the tokens before each position); rows
without drafts may have anything. ``bad_words`` depend on those tokens too: a row with bad
words samples position ``j`` as if its output went on with drafts ``0 .. j - 1``. A seeded
row draws its uniforms and exponential noise from its own generator, in a fixed order, so
its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional

import torch

from ingot.runner.sampler import (NO_TOKEN, DeviceSample, Sampler, SamplingRow, TokenLogprobs, TokenMask, _h2d,
                                  apply_token_mask, no_token_left)


@dataclass
class VerifyOutput:
    """Per batch row: the tokens it emits (its accepted drafts, then one sampled token), how
    many drafts it kept, the logprobs of each emitted token (None unless asked) and why
    the row failed (None: it did not)."""

    tokens: List[List[int]]
    num_accepted: List[int]
    logprobs: List[Optional[List[TokenLogprobs]]]
    errors: Optional[List[Optional[str]]] = None
    prompt_logprobs: None = None

    @property
    def token_ids(self) -> List[int]:
        """Each row's first emitted token (all a row without drafts emits)."""
        return [t[0] for t in self.tokens]


class DeviceVerify:
    """A verify step's results on the device; ``to_host`` reads them back (one sync)."""

    tokens = None  # nothing for a next step to read on the device: verify steps are not overlapped

    def __init__(self, counts: List[int], drafts: List[List[int]], accept: torch.Tensor, alt: torch.Tensor,
                 logprobs: Optional[DeviceSample], lp_positions: List[int]) -> None:
        self._counts, self._drafts = counts, drafts
        self._packed = torch.stack([accept.to(torch.int64), alt])
        self._logprobs, self._lp_positions = logprobs, lp_positions

    def start_copy(self) -> None:
        """(Read back synchronously: the engine reads a verify step at once.)"""

    def to_host(self) -> VerifyOutput:
        accept, alt = self._packed.tolist()
        lp_by_pos: dict[int, TokenLogprobs] = {}
        if self._logprobs is not None:
            entries = self._logprobs.to_host().logprobs
            lp_by_pos = {pos: entries[pos] for pos in self._lp_positions}  # type: ignore[misc]
        tokens, accepted, logprobs = [], [], []
        errors: Optional[List[Optional[str]]] = None
        start = 0
        for count, drafts in zip(self._counts, self._drafts):
            emitted = []
            for j in range(count):
                if j < count - 1 and accept[start + j]:
                    emitted.append(drafts[j])
                    continue
                emitted.append(alt[start + j])
                break
            if emitted[-1] < 0:
                errors = errors or [None] * len(self._counts)
                errors[len(tokens)] = NO_TOKEN
            tokens.append(emitted)
            accepted.append(len(emitted) - 1)
            logprobs.append([lp_by_pos[start + j] for j in range(len(emitted))] if start in lp_by_pos else None)
            start += count
        return VerifyOutput(tokens, accepted, logprobs, errors)


def verify_drafts(sampler: Sampler, logits: torch.Tensor, rows: List[SamplingRow], drafts: List[List[int]],
                  mask: Optional[TokenMask] = None, draft_probs: Optional[torch.Tensor] = None) -> DeviceVerify:
    """Queue the verification of ``drafts`` (per row, possibly empty) against ``logits``
    ([sum(len(d) + 1), V], each row's positions in order). ``mask``: the grammar rows'
    allowed tokens, its rows logits rows (every position of a grammar row: the tokens allowed
    after its drafts before it, ``Grammars.token_mask``). ``draft_probs``: the draft
    distribution ``q`` each draft of a sampled row was drawn from ([sum(len(d) + 1), V'],
    V' <= V, per position like ``logits``; a row's last position unread); None: every draft
    a point mass."""
    counts = [len(d) + 1 for d in drafts]
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    total = starts[-1]
    if logits.dim() != 2 or logits.shape[0] != total:
        raise ValueError(f"logits must be [{total}, vocab], got {tuple(logits.shape)}")
    device = logits.device
    if mask is not None and mask.rows:  # a grammar row's allowed tokens at each of its positions
        apply_token_mask(logits, mask)
    pos_rows = [row for row, c in zip(rows, counts) for _ in range(c)]
    for r, (row, d) in enumerate(zip(rows, drafts)):
        if d and row.params.bad_words_token_ids:  # position j follows drafts[:j]
            for j in range(1, len(d) + 1):
                pos_rows[starts[r] + j] = dataclasses.replace(row, output_token_ids=row.output_token_ids + d[:j])
    # each position's draft (-1 at a row's last position: nothing to test there)
    flat_drafts = [t for d in drafts for t in (*d, -1)]
    draft_t = _h2d(flat_drafts, device)
    x = sampler.process_logits(logits, pos_rows)
    alt = x.argmax(dim=-1)
    accept = alt == draft_t
    sampled = [r for r, row in enumerate(rows) if not row.params.greedy]
    if sampled:
        positions = [p for r in sampled for p in range(starts[r], starts[r + 1])]
        idx = _h2d(positions, device)
        probs = _normalised(Sampler.probs(x[idx], pos_rows, positions))
        u, noise = _draws(sampler, rows, sampled, counts, probs.shape[1], device)
        d = draft_t[idx]
        has_draft = d >= 0
        at = d.clamp(min=0)[:, None]
        if draft_probs is None:  # point masses (no draft at a row's last position)
            q = torch.zeros_like(probs).scatter_(1, at, has_draft[:, None].to(probs.dtype))
        else:
            q = torch.zeros_like(probs)
            q[:, : draft_probs.shape[1]] = draft_probs[idx]
            q.mul_(has_draft[:, None])
        # kept with probability min(1, p(x) / q(x)), without dividing
        ok = has_draft & (u * q.gather(1, at)[:, 0] < probs.gather(1, at)[:, 0])
        resid = (probs - q).clamp_(min=0.0)
        # a residual of no mass (q = p but for rounding: x is kept but for rounding): sample p itself
        resid = torch.where(resid.sum(dim=-1, keepdim=True) > 0, resid, probs)
        accept[idx] = ok
        alt[idx] = (resid / noise).argmax(dim=-1)
    want = [r for r, row in enumerate(rows) if row.params.logprobs is not None]
    lp_sample, lp_positions = None, []
    if want:
        lp_positions = [p for r in want for p in range(starts[r], starts[r + 1])]
        emit = torch.where(accept & (draft_t >= 0), draft_t, alt)  # the token each position emits if reached
        params = [row.params for row in pos_rows]
        lp_sample = Sampler._with_logprobs(logits, emit, params, lp_positions)
    if any(row.params.has_token_rules for row in rows):  # a position whose rules leave no token fails its row
        dead = no_token_left(x)
        accept &= ~dead
        alt.masked_fill_(dead, -1)
    return DeviceVerify(counts, drafts, accept, alt, lp_sample, lp_positions)


def sample_drafts(sampler: Sampler, logits: torch.Tensor, rows: List[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft model's drafts for sampled rows: each drawn from the draft's distribution ``q``
    under its row's parameters (``Sampler.process_logits``, ``Sampler.probs``, renormalised),
    a seeded row from its own generator. Returns (tokens [n], q [n, V]) for ``verify_drafts``."""
    which = list(range(len(rows)))
    q = _normalised(Sampler.probs(sampler.process_logits(logits, rows), rows, which))
    _, noise = _draws(sampler, rows, which, [1] * len(rows), q.shape[1], logits.device)
    return (q / noise).argmax(dim=-1), q


def _normalised(probs: torch.Tensor) -> torch.Tensor:
    """``Sampler.probs`` summing to 1 per row (min-p zeroes tokens without renormalising:
    sampling does not need it, acceptance probabilities do)."""
    return probs / probs.sum(dim=-1, keepdim=True)


def _draws(sampler: Sampler, rows: List[SamplingRow], sampled: List[int], counts: List[int], vocab: int,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms [P] and exponential noise [P, V] for the positions of the ``sampled`` rows:
    a seeded row's from its own generator (noise, then uniforms), the others' from the
    sampler's."""
    n = sum(counts[r] for r in sampled)
    u = torch.empty(n, device=device)
    noise = torch.empty(n, vocab, device=device)
    start = 0
    for r in sampled:
        gen = rows[r].generator or sampler.generator
        c = counts[r]
        noise[start : start + c].exponential_(generator=gen)
        u[start : start + c].uniform_(generator=gen)
        start += c
    noise.clamp_min_(torch.finfo(torch.float32).tiny)  # exponential_ may return exactly 0
    return u, noise
