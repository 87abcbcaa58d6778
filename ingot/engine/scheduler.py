"""Continuous batching: choose each step's sequences, prefill or decode, and their KV blocks.

Policy (one step is either all-prefill or all-decode):
1. Prefill first: sequences already part-way through a chunked prefill, then
   waiting requests in arrival order, within ``max_num_batched_tokens`` and
   ``max_num_seqs``. A long prompt is split into chunks across steps. A waiting
   request is admitted once the blocks of its whole prompt are free (besides
   those the prompts still in prefill will take); until then it keeps waiting.
   With prefix caching, a request starts after its longest cached prefix of
   full blocks: those cost neither new blocks nor batched tokens. A request
   with ``wait_for`` set is passed over (later ones go ahead) until that
   sequence has computed its prompt. With ``prefill_wave_tokens``, while
   sequences decode, waiting requests are admitted only in waves (see
   ``_wave_ready``): each prefill step stalls the whole decode batch.
2. Otherwise decode every running sequence by one token. When a sequence
   needs a new block and none is free, the newest running sequence is
   preempted: its blocks are freed and it goes back to the front of the queue,
   to be recomputed later (never dropped).

When every layer attends within a sliding window (``BlockManager.window``), each
scheduled sequence first hands back the blocks its next query can no longer see.

After each step the engine calls ``on_step_done``: it counts the computed
tokens and registers the blocks that became full in the prefix cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from ingot.engine.block_manager import BlockManager
from ingot.engine.sequence import Sequence, Status
from ingot.runner.batch import ScheduledBatch


@dataclass
class SchedulerStats:
    """Counters since the engine started (read them as differences over a run)."""

    num_preemptions: int = 0
    # prompt tokens of requests at their first admission, with prefix caching on, and how
    # many of those were taken from the prefix cache (re-admissions after preemption excluded)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # steps launched: prefill steps, decode steps and the sequences of those (mean batch)
    prefill_steps: int = 0
    decode_steps: int = 0
    decode_rows: int = 0

    @property
    def prefix_cache_hit_rate(self) -> Optional[float]:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else None


class Scheduler:
    # a prompt held back for a wave is admitted after at most this many decode steps
    MAX_WAVE_WAIT_STEPS = 32
    WAVE_WAIT_PER_RUNNING = 8

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 prefill_wave_tokens: int = 0) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_wave_tokens = prefill_wave_tokens
        self._wave_wait = 0  # decode steps the waiting queue has been held back for a wave
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ step
    def schedule(self) -> ScheduledBatch | None:
        batch = self._schedule_prefill()
        if batch.seqs:
            return batch
        batch = self._schedule_decode()
        return batch if batch.seqs else None

    def _schedule_prefill(self) -> ScheduledBatch:
        batch = ScheduledBatch([], True)
        budget = self.max_num_batched_tokens
        # a decode-only step is the common case: find the (few) prefilling sequences without
        # calling Sequence.is_prefill per running sequence (this runs on every step)
        prefilling = [s for s in self.running
                      if s.num_computed_tokens < len(s.prompt_token_ids) + len(s.output_token_ids) + s.num_pending - 1]
        for seq in prefilling:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted to make room for an older one
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            self.blocks.drop_outside_window(seq, seq.num_computed_tokens)
            if not self._make_room(seq, seq.num_computed_tokens + n):
                continue
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        if self.prefill_wave_tokens and not batch.seqs and not self._wave_ready(budget):
            return batch
        # A request is admitted only if every block its prompt needs is free now, besides those
        # the prompts already in prefill still need. Admitted on its first chunk alone, a prompt
        # that cannot finish preempts itself and comes back, step after step, and since prefill
        # steps go first, no decode ever runs (a livelock under a full KV cache).
        reserved = sum(self.blocks.extra_blocks(s, s.num_tokens) for s in prefilling if s.status is Status.RUNNING)
        held_back: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if (seq.wait_for is not None and self._held_back(seq)) or seq.num_pending:
                # (a sequence preempted while a step in flight samples its next token waits
                # for that token: its prefill must recompute it too)
                held_back.append(self.waiting.popleft())
                continue
            hits = self.blocks.match(seq)
            cached = len(hits) * self.blocks.block_size
            n = min(seq.num_tokens - cached, budget)
            if not self.blocks.can_admit(hits, seq.num_tokens, reserved):
                break
            self.waiting.popleft()
            self.blocks.admit(seq, hits, cached + n)
            self.blocks.drop_outside_window(seq, cached)
            reserved += self.blocks.extra_blocks(seq, seq.num_tokens)
            seq.num_computed_tokens = cached
            if seq.num_preemptions == 0 and self.blocks.caching:
                seq.num_cached_tokens = cached
                self.stats.prefix_cache_queries += seq.num_tokens
                self.stats.prefix_cache_hits += cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        self.waiting.extendleft(reversed(held_back))
        return batch

    def _wave_ready(self, budget: int) -> bool:
        """With ``prefill_wave_tokens``: may waiting prompts interrupt decoding now?

        Yes when nothing decodes, when the prompts the free slots would take add up to a
        wave (a prefill step big enough to be worth stalling the decode batch for), or
        when the queue has waited ``max_wave_wait()`` decode steps; otherwise the
        waiting prompts sit out this step (and it decodes).
        """
        free = self.max_num_seqs - len(self.running)
        if not self.running or not self.waiting or free <= 0:
            self._wave_wait = 0
            return True
        tokens = 0
        for i, seq in enumerate(self.waiting):
            if i >= free or tokens >= self.prefill_wave_tokens:
                break
            tokens += seq.num_tokens
        if tokens >= min(self.prefill_wave_tokens, budget) or self._wave_wait >= self.max_wave_wait():
            self._wave_wait = 0
            return True
        self._wave_wait += 1
        return False

    def max_wave_wait(self) -> int:
        """Decode steps the queue may sit out: one per ``WAVE_WAIT_PER_RUNNING`` running
        sequences (a prefill step stalls them all, holding a prompt costs it alone), at most
        ``MAX_WAVE_WAIT_STEPS``; so a lightly loaded server admits at once."""
        return min(self.MAX_WAVE_WAIT_STEPS, len(self.running) // self.WAVE_WAIT_PER_RUNNING)

    def _held_back(self, seq: Sequence) -> bool:
        """Must ``seq`` keep waiting for ``seq.wait_for`` to compute its prompt (and cache it)?

        Not once that sequence's full prompt blocks are in the prefix cache (registered when
        the step that computed them has been read back: with overlap scheduling, a step
        later than it was launched) or it has ended; never with prefix caching off (there
        is nothing to wait for).
        """
        first = seq.wait_for
        assert first is not None
        full = len(first.prompt_token_ids) // self.blocks.block_size
        if not self.blocks.caching or first.status is Status.FINISHED or first.num_cached_blocks >= full:
            seq.wait_for = None
            return False
        return True

    def _schedule_decode(self) -> ScheduledBatch:
        batch = ScheduledBatch([], False)
        block_size = self.blocks.block_size
        windowed = self.blocks.window is not None
        for seq in list(self.running):
            n = len(seq.prompt_token_ids) + len(seq.output_token_ids) + seq.num_pending  # seq.num_tokens, inlined
            if seq.status is not Status.RUNNING or seq.num_computed_tokens < n - 1:  # preempted, or prefill
                continue
            if seq.num_pending and seq.done_after_pending:  # its pending token ends it (overlap)
                continue
            if windowed:
                self.blocks.drop_outside_window(seq, n - 1)
            draft = seq.draft_token_ids
            if draft:  # speculative decoding: room for the drafts too, or no drafts (never a preemption)
                seq.draft_token_ids = []
                if seq.num_pending or not self.blocks.can_grow(seq, n + len(draft)):
                    draft = []
                else:
                    self.blocks.grow(seq, n + len(draft))
                    if batch.draft_tokens is None:
                        batch.draft_tokens = [[] for _ in batch.seqs]
            # most steps the new token still fits the last block: no allocation to try
            if n > len(seq.block_ids) * block_size and not self._make_room(seq, n):
                continue  # seq itself was preempted
            batch.seqs.append(seq)
            batch.num_new_tokens.append(1 + len(draft))
            if batch.draft_tokens is not None:
                batch.draft_tokens.append(draft)
        return batch

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq`` to ``num_tokens``, preempting the newest others; False if ``seq`` went."""
        while not self.blocks.can_grow(seq, num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.blocks.grow(seq, num_tokens)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free its blocks; it will be recomputed from its tokens when rescheduled."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ around the step
    def on_step_launched(self, batch: ScheduledBatch) -> list[int]:
        """The step is queued on the device: count each sequence's computed tokens now (the
        next schedule builds on them) and return them, per row, for ``on_step_done``."""
        if batch.is_prefill:
            self.stats.prefill_steps += 1
        else:
            self.stats.decode_steps += 1
            self.stats.decode_rows += len(batch.seqs)
        running = Status.RUNNING
        computed = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.status is running:
                seq.num_computed_tokens += n
            computed.append(seq.num_computed_tokens)
        return computed

    def on_step_done(self, batch: ScheduledBatch, computed: list[int]) -> None:
        """The step ran: with prefix caching, register the blocks it filled, up to what it
        computed (``computed``, from ``on_step_launched``: a later step may be in flight),
        and mark those a draft model's frontier has passed (``BlockManager.mark_draft_kv``:
        a frontier counts steps queued on the device, which run before any later hit's).

        A sequence ended or preempted since it was scheduled is skipped. Decode steps hash
        nothing unless a sequence's last block just filled up.
        """
        if not self.blocks.caching:
            return
        running = Status.RUNNING
        block_size = self.blocks.block_size
        register, mark = self.blocks.cache_full_blocks, self.blocks.mark_draft_kv
        for seq, upto in zip(batch.seqs, computed):
            if seq.status is running:
                if upto // block_size > seq.num_cached_blocks:
                    register(seq, upto)  # type: ignore[arg-type]
                if seq.draft_kv_len // block_size > seq.num_draft_blocks:
                    mark(seq)  # type: ignore[arg-type]

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED
