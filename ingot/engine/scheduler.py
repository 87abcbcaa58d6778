"""Continuous batching: choose each step's sequences, prefill or decode, and their KV blocks.

Policy (one step is either all-prefill or all-decode):
1. Prefill first: sequences already part-way through a chunked prefill, then
   waiting requests in arrival order, within ``max_num_batched_tokens`` and
   ``max_num_seqs``. A long prompt is split into chunks across steps. A waiting
   request whose blocks are not free yet keeps waiting.
2. Otherwise decode every running sequence by one token. When a sequence
   needs a new block and none is free, the newest running sequence is
   preempted: its blocks are freed and it goes back to the front of the queue,
   to be recomputed later (never dropped).
"""

from __future__ import annotations

from collections import deque

from ingot.engine.block_manager import BlockManager
from ingot.engine.sequence import Sequence, Status
from ingot.runner.batch import ScheduledBatch


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

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
                      if s.num_computed_tokens < len(s.prompt_token_ids) + len(s.output_token_ids) - 1]
        for seq in prefilling:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted to make room for an older one
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, seq.num_computed_tokens + n):
                continue
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
                break
            self.waiting.popleft()
            self.blocks.grow(seq, seq.num_computed_tokens + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _schedule_decode(self) -> ScheduledBatch:
        batch = ScheduledBatch([], False)
        block_size = self.blocks.block_size
        for seq in list(self.running):
            n = len(seq.prompt_token_ids) + len(seq.output_token_ids)  # seq.num_tokens, inlined
            if seq.status is not Status.RUNNING or seq.num_computed_tokens < n - 1:  # preempted, or prefill
                continue
            # most steps the new token still fits the last block: no allocation to try
            if n > len(seq.block_ids) * block_size and not self._make_room(seq, n):
                continue  # seq itself was preempted
            batch.seqs.append(seq)
            batch.num_new_tokens.append(1)
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
        self.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ after the step
    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED
