"""Structured outputs, each step's side: a sequence's matcher (``SequenceGrammar``), the
matchers advanced by a step's tokens (``advance``) and the step's allowed-token bitmask
(``StepMasks``: ``token_mask``, called by the runner once the step's forward is queued).

Where the work runs:

- ``StepMasks.token_mask`` (the engine loop, inside a launch) fills each constrained row
  from its matcher; the sampler applies the bitmask on the device;
- ``StepMasks.ahead`` (CUDA with overlap scheduling): once a step is left in flight, one
  thread waits for its tokens, advances its rows' matchers (``advance``: one xgrammar call
  for the rows the grammar decides) and fills their rows of the next step's bitmask
  (``StepMasks.fill_ahead``) while the engine loop prepares the next step; the next step's
  ``token_mask`` takes those rows. xgrammar releases the GIL in both calls. The engine
  waits for that thread before it reads or changes those sequences' matchers again.
"""

from __future__ import annotations

import logging
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, TypeVar

import numpy as np
import torch

from ingot.engine.reasoning import ACTIVE, OPENING, REASONING, ReasoningTags
from ingot.runner.sampler import TokenMask

log = logging.getLogger(__name__)
T = TypeVar("T")

BATCH_FILL_ROWS = 16  # from this many constrained rows, xgrammar fills the bitmask in its own threads
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " in front of a message


def xgrammar() -> Any:
    """The xgrammar module, imported on first use (it takes a second or two: transformers)."""
    import xgrammar as xgr

    return xgr


def xgrammar_message(exc: BaseException) -> str:
    """An xgrammar exception's first line, without the source location in front."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _LOG_PREFIX.sub("", text)


class SequenceGrammar:
    """One sequence's matcher: it accepts each token the sequence keeps, once (a preempted
    sequence recomputes its tokens without sampling them: nothing reaches the matcher).

    With a reasoning parser (``tags``) the sequence may start in its reasoning (``phase``,
    engine/reasoning.py): those tokens never reach the matcher, which takes the tokens after
    ``</think>``. ``mark`` / ``restore`` walk a verify step's drafts and go back."""

    def __init__(self, matcher: Any, phase: str = ACTIVE, tags: Optional[ReasoningTags] = None) -> None:
        self.matcher = matcher
        self.phase = phase
        self.tags = tags
        self.num_accepted = 0  # tokens taken, the reasoning's included (what min_tokens counts)
        self.num_matched = 0  # of them, those the matcher accepted
        self.error: Optional[str] = None  # once set, the sequence fails at its next read-back

    @property
    def terminated(self) -> bool:
        """The grammar ended: it accepted a stop token after a complete output."""
        return self.matcher.is_terminated()

    def take(self, token: int) -> bool:
        """Advance by ``token``; False (nothing changed) if the grammar refuses it."""
        if self.phase == REASONING:
            if token == self.tags.end:
                self.phase = ACTIVE
        elif self.phase == OPENING and token == self.tags.start:
            self.phase = REASONING
        elif self.matcher.accept_token(token):
            self.phase = ACTIVE
            self.num_matched += 1
        else:
            return False
        self.num_accepted += 1
        return True

    def accept(self, token: int) -> None:
        if self.error is not None:
            return
        try:
            ok = self.take(token)
        except Exception as exc:
            self.error = f"structured outputs: the grammar matcher failed: {xgrammar_message(exc)}"
            return
        if not ok:
            self.error = f"structured outputs: token {token} is not allowed by the grammar"

    def mark(self) -> tuple[str, int, int]:
        return self.phase, self.num_accepted, self.num_matched

    def restore(self, mark: tuple[str, int, int]) -> None:
        """Back to ``mark`` (the tokens taken since, rolled back)."""
        if self.num_matched > mark[2]:
            self.matcher.rollback(self.num_matched - mark[2])
        self.phase, self.num_accepted, self.num_matched = mark

    @property
    def live(self) -> bool:
        """Has it a next token to constrain (neither failed nor ended)?"""
        return self.error is None and not self.matcher.is_terminated()

    def fill(self, bitmask: Any, row: int) -> bool:
        """Row ``row`` of ``bitmask``: the tokens allowed next; False (and ``error``) if it failed."""
        if self.phase != REASONING:
            try:
                self.matcher.fill_next_token_bitmask(bitmask, row)
            except Exception as exc:
                self.error = f"structured outputs: the grammar matcher failed: {xgrammar_message(exc)}"
                return False
        self.amend(bitmask, row)
        return True

    def amend(self, bitmask: torch.Tensor, row: int) -> None:
        """Row ``row`` as the reasoning makes it, once the matcher has filled it (outside the
        reasoning): in the reasoning every token; where the reply may open its reasoning,
        ``<think>`` besides the grammar's tokens."""
        if self.phase == REASONING:
            bitmask[row] = -1
        elif self.phase == OPENING:
            t = self.tags.start
            bitmask.numpy().view(np.uint32)[row, t >> 5] |= np.uint32(1 << (t & 31))


def _hold_stop_tokens(line: np.ndarray, stop_ids: Sequence[int]) -> None:
    """Below ``min_tokens``: take the stop tokens out of a row of the bitmask (its uint32
    words), unless nothing else is allowed (a complete output may only stop)."""
    kept = line.copy()
    for t in stop_ids:
        if 0 <= t < 32 * line.shape[0]:
            line[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
    if not line.any():
        line[:] = kept


@dataclass
class NextMasks:
    """A step's grammar sequences (``seqs``, in its sampling order) and their rows of the next
    step's bitmask, filled once the step's tokens were accepted (``Grammars.fill_ahead``)."""

    seqs: list[Any]
    bitmask: torch.Tensor


class StepMasks:
    """Each step's bitmask of the constrained rows, ``vocab_size`` wide (in pinned memory on
    CUDA: PyTorch's pinned cache reuses a block only once its copy to the device is done,
    so the copy never waits for the forward)."""

    def __init__(self, vocab_size: int, pin_memory: bool = False, ahead: bool = False) -> None:
        self.vocab_size = vocab_size  # the logits' width: the tokenizer's ids, padded to the model's
        self.pin_memory = pin_memory
        # fill the next step's rows in a thread as soon as a step's tokens are back (the engine
        # sets it on CUDA, where they come back while the host prepares the next step)
        self.ahead = ahead
        self._batch_fill: dict[bool, Any] = {}  # xgrammar's threaded fill: the loop's, the ahead thread's
        self._ahead_pool: Optional[ThreadPoolExecutor] = None

    def token_mask(self, batch_seqs: Sequence[Any], stop_ids: Sequence[int],
                   wait_previous: Optional[Callable[[], Optional[NextMasks]]], rows: list[int],
                   drafts: Optional[list[list[int]]] = None) -> Optional[TokenMask]:
        """The allowed tokens of the constrained rows among ``rows`` (the batch rows that
        sample, in logits order). Called by the runner once the step's forward is queued. A
        constrained row whose last token is still on the device (overlap scheduling) needs
        its matcher to have accepted it: ``wait_previous`` reads the previous step back and
        advances its matchers (with ``ahead``: waits for the thread that did, and takes the
        rows it filled). ``drafts``: a verify step's drafts per batch row; the mask then
        has a row per position (``_draft_mask``). Never raises: a failure fails the rows'
        requests at read-back."""
        seqs = [batch_seqs[r] for r in rows]
        constrained = [j for j, seq in enumerate(seqs) if seq.grammar is not None]
        try:
            filled = None
            if wait_previous is not None and any(seqs[j].num_pending for j in constrained):
                filled = wait_previous()
            if not constrained:
                return None
            if drafts is not None:
                return self._draft_mask(seqs, [drafts[r] for r in rows], constrained, stop_ids)
            return TokenMask(constrained, self._rows([seqs[j] for j in constrained], filled, stop_ids))
        except Exception as exc:
            log.exception("structured outputs: the token mask failed")
            for j in constrained:
                seqs[j].grammar.error = f"structured outputs: {type(exc).__name__}: {exc}"
            return None

    def _rows(self, seqs: list[Any], filled: Optional[NextMasks], stop_ids: Sequence[int]) -> torch.Tensor:
        """The bitmask of ``seqs``: the rows ``filled`` ahead holds (all of it when it holds
        these sequences in this order, the usual decode step), the others filled here."""
        if filled is not None and len(filled.seqs) == len(seqs) and all(a is b for a, b in zip(filled.seqs, seqs)):
            return filled.bitmask
        bitmask = self._new_bitmask(len(seqs))
        todo = list(enumerate(seqs))
        if filled is not None:
            have = {id(seq): k for k, seq in enumerate(filled.seqs)}
            src, dst, todo = [], [], []
            for i, seq in enumerate(seqs):
                k = have.get(id(seq))
                if k is None:
                    todo.append((i, seq))
                else:
                    src.append(k)
                    dst.append(i)
            if src:
                bitmask.numpy()[dst] = filled.bitmask.numpy()[src]
        self._fill_rows(bitmask, todo, stop_ids, ahead=False)
        return bitmask

    def fill_ahead(self, seqs: Sequence[Any], stop_ids: Sequence[int]) -> NextMasks:
        """The next step's rows of ``seqs``' grammar sequences, once their matchers have
        accepted the tokens of the step ``seqs`` sampled in (the ahead thread)."""
        chosen = [seq for seq in seqs if seq.grammar is not None]
        bitmask = self._new_bitmask(len(chosen))
        self._fill_rows(bitmask, list(enumerate(chosen)), stop_ids, ahead=True)
        return NextMasks(chosen, bitmask)

    def run_ahead(self, fn: Callable[[], T]) -> Future:
        """``fn`` in the ahead thread (one: the steps' jobs run in order)."""
        if self._ahead_pool is None:
            self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="ingot-grammar-ahead")
        return self._ahead_pool.submit(fn)

    def _new_bitmask(self, n: int) -> torch.Tensor:
        return torch.empty((n, (self.vocab_size + 31) // 32), dtype=torch.int32, pin_memory=self.pin_memory)

    def _fill_rows(self, bitmask: torch.Tensor, rows: list[tuple[int, Any]], stop_ids: Sequence[int],
                   ahead: bool) -> None:
        """Rows ``i`` of ``bitmask`` for sequences ``seq`` (``rows``: (i, seq)): what the grammar
        allows next, without the stop tokens below ``min_tokens``; every token for one that has
        ended or failed (its token is dropped)."""
        words = bitmask.numpy().view(np.uint32)
        live, held = [], []
        for i, seq in rows:
            grammar = seq.grammar
            if grammar.live:
                live.append((i, grammar))
            else:
                words[i] = 0xFFFFFFFF
            if grammar.num_accepted < seq.params.min_tokens:
                held.append((i, seq))
        self._fill(bitmask, live, ahead)
        for i, grammar in live:
            if grammar.error is not None:  # its fill failed
                words[i] = 0xFFFFFFFF
        for i, seq in held:
            if seq.grammar.error is None:
                _hold_stop_tokens(words[i], (*stop_ids, *seq.params.stop_token_ids))

    def _draft_mask(self, seqs: list[Any], drafts: list[list[int]], constrained: list[int],
                    stop_ids: Sequence[int]) -> TokenMask:
        """A verify step's mask: each constrained row's allowed tokens at each of its positions
        (rows of the logits: a row's last token, then its drafts), its matcher walked through
        the drafts and rolled back (a draft ``</think>`` ends the reasoning for the positions
        after it). Past a draft the grammar refuses (the target never keeps it: its own
        position's mask excludes it) or past the grammar's end, every token is allowed: no
        kept token is sampled there."""
        starts = [0]
        for d in drafts:
            starts.append(starts[-1] + len(d) + 1)
        rows = [starts[j] + i for j in constrained for i in range(len(drafts[j]) + 1)]
        bitmask = torch.full((len(rows), (self.vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=self.pin_memory)
        words = bitmask.numpy().view(np.uint32)
        at = 0
        for j in constrained:
            grammar, params = seqs[j].grammar, seqs[j].params
            mark = grammar.mark()
            try:
                for i in range(len(drafts[j]) + 1):
                    if not grammar.live or not grammar.fill(bitmask, at + i):
                        break
                    if grammar.num_accepted < params.min_tokens:
                        _hold_stop_tokens(words[at + i], (*stop_ids, *params.stop_token_ids))
                    if i == len(drafts[j]) or not grammar.take(drafts[j][i]):
                        break
            finally:
                grammar.restore(mark)
            if grammar.error is not None:
                bitmask[at : at + len(drafts[j]) + 1] = -1
            at += len(drafts[j]) + 1
        return TokenMask(rows, bitmask)

    def _fill(self, bitmask: torch.Tensor, live: list[tuple[int, SequenceGrammar]], ahead: bool = False) -> None:
        """Fill the live rows: many at once through xgrammar's threaded batch fill (the rows
        whose matcher decides: not in their reasoning; the ahead thread has its own batch
        filler); a failure there (or a few rows) row by row, so that a failing matcher fails
        alone."""
        matched = live if all(g.phase == ACTIVE for _, g in live) else [(i, g) for i, g in live if g.phase != REASONING]
        if len(matched) >= BATCH_FILL_ROWS:
            batch = self._batch_fill.get(ahead)
            if batch is None:
                cores = os.cpu_count() or 1
                threads = max(1, min(8, cores - 1 if ahead else cores))  # beside the ahead thread, the loop keeps a core
                batch = self._batch_fill[ahead] = xgrammar().BatchGrammarMatcher(max_threads=threads)
            indices = [i for i, _ in matched]
            try:
                batch.batch_fill_next_token_bitmask([g.matcher for _, g in matched], bitmask,
                                                    None if indices[-1] == len(indices) - 1 else indices)
                if matched is not live:
                    for i, g in live:
                        g.amend(bitmask, i)
                return
            except Exception:
                pass
        for i, grammar in live:
            grammar.fill(bitmask, i)

    def close(self) -> None:
        if self._ahead_pool is not None:
            self._ahead_pool.shutdown(wait=False, cancel_futures=True)


def advance(seqs: Sequence[Any], tokens: Sequence[int], errors: Optional[Sequence[Optional[str]]],
            batched: bool = False) -> None:
    """Each constrained, unfinished sequence's matcher accepts the token it sampled (rows
    whose sampling failed are skipped; a rejected token sets ``grammar.error``).

    ``batched`` (the ahead thread): the rows the grammar decides (outside any reasoning, an
    xgrammar matcher) in one xgrammar call, which gives the GIL up once; row by row, each
    call gives it up and takes it back, and a thread beside the engine loop may wait for
    the loop at each. In the loop, row by row is as fast (the batched call converts its
    arguments and results element by element)."""
    batch: list[tuple[SequenceGrammar, int]] = []
    matcher_type = xgrammar().GrammarMatcher if batched else None
    for k, seq in enumerate(seqs):
        grammar = seq.grammar
        if grammar is None or seq.finished or (errors is not None and errors[k] is not None):
            continue
        if batched and grammar.error is None and grammar.phase == ACTIVE and type(grammar.matcher) is matcher_type:
            batch.append((grammar, tokens[k]))
        else:
            grammar.accept(tokens[k])
    if not batch:
        return
    try:
        accepted = xgrammar().BatchGrammarMatcher.batch_accept_token([g.matcher for g, _ in batch], [t for _, t in batch])
    except Exception as exc:  # not seen: xgrammar answers False for a token it refuses
        for grammar, _ in batch:
            grammar.error = f"structured outputs: the grammar matcher failed: {xgrammar_message(exc)}"
        return
    for (grammar, token), ok in zip(batch, accepted):
        if ok:
            grammar.num_matched += 1
            grammar.num_accepted += 1
        else:
            grammar.error = f"structured outputs: token {token} is not allowed by the grammar"
