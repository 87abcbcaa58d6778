"""A fake model over a fake KV pool, and the block-accounting invariants, for scheduler tests.

``FakeKV`` plays the runner: for each scheduled sequence it writes
(salt, position, token) into the slots its block table names, and when the
step samples it reads the whole context back through the block table and
checks it is the sequence's own tokens. A block shared wrongly (evicted while
held, registered before its KV existed, matched across salts) shows up as a
wrong or missing slot. The sampled token is a hash of the token sequence, so
every sequence has one right continuation, computed alone by ``alone``.
"""

from __future__ import annotations

import hashlib
from collections import Counter

from ingot.engine.scheduler import Scheduler
from ingot.engine.sequence import Sequence, Status
from ingot.runner.batch import ScheduledBatch
from ingot.sampling_params import SamplingParams

VOCAB = 50


def next_token(tokens: list[int]) -> int:
    digest = hashlib.blake2b(repr(tokens).encode(), digest_size=4).digest()
    return 3 + int.from_bytes(digest, "little") % (VOCAB - 3)


def alone(prompt: list[int], max_tokens: int) -> list[int]:
    """The greedy output of ``prompt`` on the fake model, without any scheduler."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def make_seq(prompt: list[int], max_tokens: int, rid: str = "r", salt=None, wait_for=None) -> Sequence:
    return Sequence(rid, None, prompt, SamplingParams(max_tokens=max_tokens), detok=None, cache_salt=salt, wait_for=wait_for)


class FakeKV:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list = [None] * (num_blocks * block_size)

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def run(self, batch: ScheduledBatch, skip: frozenset = frozenset()) -> list:
        """Compute the batch (except the sequences in ``skip``); the sampled token per row (None if none)."""
        out = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if id(seq) in skip:
                out.append(None)
                continue
            start = seq.num_computed_tokens
            assert start + n <= len(seq.block_ids) * self.block_size, "the scheduler gave too few blocks"
            tokens = seq.tokens(0, start + n)
            for pos in range(start, start + n):
                assert seq.block_ids[pos // self.block_size] != 0, "never write the dummy block"
                self.slots[self.slot(seq, pos)] = (seq.cache_salt, pos, tokens[pos])
            if batch.samples(i):
                context = [self.slots[self.slot(seq, pos)] for pos in range(start + n)]
                expected = [(seq.cache_salt, pos, t) for pos, t in enumerate(tokens)]
                assert context == expected, f"{seq.request_id}: the KV read back is not its own tokens"
                out.append(next_token(tokens))
            else:
                out.append(None)
        return out


def finish_step(sched: Scheduler, batch: ScheduledBatch, sampled: list) -> list[Sequence]:
    """What the engine does after a step: on_step_done, append tokens, finish at max_tokens."""
    sched.on_step_done(batch, sched.on_step_launched(batch))
    done = []
    for seq, token in zip(batch.seqs, sampled):
        if token is None or seq.status is not Status.RUNNING:
            continue
        seq.output_token_ids.append(token)
        if len(seq.output_token_ids) >= seq.params.max_tokens:
            sched.finish(seq)
            done.append(seq)
    return done


def check_invariants(sched: Scheduler, kv: FakeKV | None = None) -> None:
    """Reference counts, free lists and the hash index agree with who holds what."""
    bm = sched.blocks
    holders: Counter = Counter()
    for seq in sched.waiting:
        assert not seq.block_ids, "a waiting sequence holds no blocks"
    for seq in sched.running:
        assert seq.status is Status.RUNNING
        assert seq.num_computed_tokens <= len(seq.block_ids) * bm.block_size
        holders.update(seq.block_ids)
    free = list(bm.free_blocks)
    evictable = list(bm.evictable)
    assert len(set(free)) == len(free) and not set(free) & set(evictable), "a block is listed free twice"
    assert 0 not in holders and 0 not in free and 0 not in evictable, "block 0 is never handed out"
    for block in range(1, bm.num_blocks):
        assert bm.ref_counts[block] == holders[block], f"block {block}: refcount {bm.ref_counts[block]}, {holders[block]} holders"
    held = set(holders)
    assert not held & (set(free) | set(evictable)), "a block is both free and held"
    assert held | set(free) | set(evictable) == set(range(1, bm.num_blocks)), "a block leaked"
    for h, block in bm.cached.items():
        assert bm.hash_of[block] == h
    hashed = {b for b in range(bm.num_blocks) if bm.hash_of[b] is not None}
    assert hashed == set(bm.cached.values())
    assert set(evictable) <= hashed and not set(free) & hashed
    if not bm.caching:
        assert not hashed and not evictable
    for seq in sched.running:
        for i, block in enumerate(seq.block_ids):
            if i >= seq.num_cached_blocks:
                assert bm.hash_of[block] is None, "a block not yet computed must not be findable"
            elif bm.hash_of[block] is not None:
                assert bm.hash_of[block] == seq.block_hashes[i], "a held block is cached under another prefix"
    if kv is not None:
        for block in hashed:  # every findable block's KV was written
            assert all(kv.slots[block * bm.block_size + j] is not None for j in range(bm.block_size))


def check_all_free(sched: Scheduler) -> None:
    bm = sched.blocks
    assert not sched.running and not sched.waiting
    assert bm.num_free == bm.num_blocks - 1 and not any(bm.ref_counts)
