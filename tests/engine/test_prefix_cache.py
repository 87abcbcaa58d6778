"""Prefix caching in the block manager and scheduler, on the fake model of fake_steps.py."""

from __future__ import annotations

import hashlib
import struct

import pytest

from ingot.engine import block_manager
from ingot.engine.block_manager import BlockManager, block_hash, root_hash
from ingot.engine.scheduler import Scheduler
from ingot.engine.sequence import Status
from tests.engine.fake_steps import FakeKV, alone, check_all_free, check_invariants, finish_step, make_seq

BS = 4


def sched_of(num_blocks: int = 64, budget: int = 64, caching: bool = True, max_num_seqs: int = 8):
    sched = Scheduler(BlockManager(num_blocks, BS, caching), max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return sched, FakeKV(num_blocks, BS)


def step(sched, kv, skip=frozenset()):
    batch = sched.schedule()
    assert batch is not None
    done = finish_step(sched, batch, kv.run(batch, skip))
    check_invariants(sched, kv)
    return batch, done


def run_all(sched, kv, seqs, limit: int = 1000):
    for _ in range(limit):
        if not sched.has_work():
            break
        step(sched, kv)
    assert not sched.has_work()
    for s in seqs:
        assert s.output_token_ids == alone(s.prompt_token_ids, s.params.max_tokens), s.request_id


PROMPT = list(range(10, 40))


def after_first(prompt: list[int], max_tokens: int, salt=None, **kw):
    """A scheduler whose first request ("a") has run its first step: its prompt blocks are cached."""
    sched, kv = sched_of(**kw)
    a = make_seq(prompt, max_tokens, "a", salt=salt)
    sched.add(a)
    step(sched, kv)
    return sched, kv, a  # 30 tokens: 7 full blocks of 4 and 2 more tokens


# ---------------------------------------------------------------- hashes
def test_block_hash_is_sha256_of_parent_and_int32_token_ids():
    parent = root_hash(None)
    want = hashlib.sha256(parent + struct.pack("<4i", 5, 6, 7, 70000)).digest()
    assert block_hash(parent, [5, 6, 7, 70000]) == want
    assert root_hash(None) != root_hash("") != root_hash("a") != root_hash("b")
    assert root_hash("tenant") == hashlib.sha256(b"ingot-kv-block\x00\x01tenant").digest()


def test_hashes_chain_over_the_whole_prefix():
    bm = BlockManager(64, BS, True)
    a, b, c = make_seq(PROMPT, 1), make_seq([99] + PROMPT[1:], 1), make_seq(PROMPT, 1, salt="x")
    ha = [bm._hash(a, i) for i in range(7)]
    hb = [bm._hash(b, i) for i in range(7)]
    hc = [bm._hash(c, i) for i in range(7)]
    assert len(set(ha)) == 7
    # b differs only in its first token: every later block's hash differs too (the chain)
    assert all(x != y for x, y in zip(ha, hb))
    assert all(x != y for x, y in zip(ha, hc)), "a salt changes every block's hash"
    assert ha[1] == block_hash(block_hash(root_hash(None), PROMPT[0:4]), PROMPT[4:8])


# ---------------------------------------------------------------- reuse
def test_second_request_reuses_the_shared_full_blocks():
    sched, kv = sched_of()
    a = make_seq(PROMPT, 3, "a")
    sched.add(a)
    step(sched, kv)  # a's prompt computed: its 7 full blocks are registered
    assert len(sched.blocks.cached) == 7
    b = make_seq(PROMPT[:13] + [3, 3, 3], 3, "b")  # shares 3 full blocks (12 tokens) and one more token
    sched.add(b)
    batch, _ = step(sched, kv)
    assert batch.seqs == [b] and batch.num_new_tokens == [4], "only the 4 tokens after the cached 12 are computed"
    assert b.num_cached_tokens == 12 and list(b.block_ids[:3]) == list(a.block_ids[:3])
    assert [sched.blocks.ref_counts[x] for x in a.block_ids[:4]] == [2, 2, 2, 1]
    assert sched.stats.prefix_cache_queries == 30 + 16 and sched.stats.prefix_cache_hits == 12
    run_all(sched, kv, [a, b])
    check_all_free(sched)


@pytest.mark.parametrize("prompt_len, hit, computed", [
    (30, 28, 2),  # every full block cached: the 2 tokens after them are computed
    (28, 24, 4),  # 7 full blocks, all cached: the last one is not taken, its 4 tokens are recomputed
    (29, 28, 1),  # 7 full blocks cached and one more token: that token alone
    (4, 0, 4),  # one full block, cached: nothing would be left, so it is recomputed
    (3, 0, 3),  # no full block
])
def test_at_least_the_last_token_is_computed(prompt_len, hit, computed):
    sched, kv, a = after_first(PROMPT, 2)
    b = make_seq(PROMPT[:prompt_len], 2, "b")
    sched.add(b)
    batch, _ = step(sched, kv)
    assert batch.seqs == [b] and batch.num_new_tokens == [computed] and b.num_cached_tokens == hit
    assert len(b.output_token_ids) == 1, "the step reaches b's last token and samples"
    run_all(sched, kv, [a, b])
    check_all_free(sched)


def test_salts_keep_tenants_apart():
    sched, kv, a = after_first(PROMPT, 2, salt="t1")
    b, c, d = make_seq(PROMPT, 2, "b", salt="t2"), make_seq(PROMPT, 2, "c"), make_seq(PROMPT, 2, "d", salt="t1")
    for s in (b, c, d):
        sched.add(s)
    step(sched, kv)
    assert (b.num_cached_tokens, c.num_cached_tokens, d.num_cached_tokens) == (0, 0, 28)
    run_all(sched, kv, [a, b, c, d])
    check_all_free(sched)


def test_same_prompt_admitted_together_is_computed_twice_and_cached_once():
    """Blocks are registered after their step: two requests admitted in one step find nothing."""
    sched, kv = sched_of()
    a, b = make_seq(PROMPT, 2, "a"), make_seq(PROMPT, 2, "b")
    sched.add(a)
    sched.add(b)
    batch, _ = step(sched, kv)
    assert batch.num_new_tokens == [30, 30] and a.num_cached_tokens == b.num_cached_tokens == 0
    assert len(sched.blocks.cached) == 7, "the duplicate blocks stay uncached"
    run_all(sched, kv, [a, b])
    check_all_free(sched)
    assert len(sched.blocks.evictable) == 7 and sched.blocks.num_free == 63


# ---------------------------------------------------------------- registration happens after the step
@pytest.mark.parametrize("how", ["abort", "preempt"])
def test_a_sequence_gone_before_its_step_ran_leaves_nothing_findable(how):
    sched, kv = sched_of()
    a = make_seq(PROMPT, 2, "a")
    sched.add(a)
    batch = sched.schedule()
    # a is aborted (or preempted) after scheduling, before the runner computed its KV
    if how == "abort":
        sched.finish(a)
    else:
        sched.preempt(a)
    finish_step(sched, batch, kv.run(batch, skip=frozenset({id(a)})))
    check_invariants(sched, kv)
    assert not sched.blocks.cached and a.num_computed_tokens == 0
    b = make_seq(PROMPT, 2, "b")
    sched.add(b)
    run_all(sched, kv, [b] + ([a] if how == "preempt" else []))
    assert b.num_cached_tokens == 0 or how == "preempt"
    check_all_free(sched)


def test_decode_hashes_only_when_a_block_fills(monkeypatch):
    sched, kv = sched_of()
    s = make_seq(PROMPT[:6], 20, "s")  # 6 tokens: one full block after prefill
    sched.add(s)
    calls = []
    real = block_manager.block_hash
    monkeypatch.setattr(block_manager, "block_hash", lambda p, t: calls.append(list(t)) or real(p, t))
    step(sched, kv)
    assert calls == [PROMPT[:4]] and s.num_cached_blocks == 1
    per_step = []
    while not s.finished:
        calls.clear()
        batch, _ = step(sched, kv)
        assert not batch.is_prefill
        per_step.append(len(calls))
    # computed tokens after each decode step: 7, 8, 9, ...; a block fills at 8, 12, 16, 20, 24
    assert per_step == [1 if (7 + i) % BS == 0 else 0 for i in range(len(per_step))]
    assert len(s.block_hashes) == 6


def test_caching_off_hashes_nothing_and_keeps_the_free_order(monkeypatch):
    monkeypatch.setattr(block_manager, "block_hash", lambda p, t: pytest.fail("hashed with caching off"))
    sched, kv = sched_of(num_blocks=10, caching=False)
    a, b = make_seq(PROMPT[:10], 3, "a"), make_seq(PROMPT[:10], 3, "b")
    sched.add(a)
    step(sched, kv)
    sched.add(b)
    step(sched, kv)
    assert list(a.block_ids) == [1, 2, 3] and list(b.block_ids) == [4, 5, 6] and b.num_cached_tokens == 0
    run_all(sched, kv, [a, b])
    assert list(sched.blocks.free_blocks) == [7, 8, 9, 1, 2, 3, 4, 5, 6]
    assert sched.stats.prefix_cache_queries == 0 and not sched.blocks.cached


# ---------------------------------------------------------------- eviction
def test_freed_blocks_stay_cached_and_are_evicted_lru_only_when_needed():
    sched, kv = sched_of(num_blocks=9)  # 8 usable blocks
    a = make_seq(PROMPT[:12], 1, "a")  # 12 tokens: 3 blocks, all full
    sched.add(a)
    run_all(sched, kv, [a])
    bm = sched.blocks
    assert list(bm.evictable) == list(reversed(a.block_ids or [1, 2, 3])) == [3, 2, 1]
    assert list(bm.free_blocks) == [4, 5, 6, 7, 8] and bm.num_free == 8
    b = make_seq([5] * 20, 1, "b")  # 5 blocks: takes the 5 uncached ones, evicts nothing
    sched.add(b)
    step(sched, kv)
    assert len(bm.cached) == 3 + 5 and list(bm.evictable) == [3, 2, 1, 8, 7, 6, 5, 4]
    c = make_seq([6] * 7, 2, "c")  # 2 blocks: evicts 3 then 2 (a's tail first), keeps a's first block
    sched.add(c)
    step(sched, kv)
    assert list(c.block_ids) == [3, 2] and list(bm.evictable)[:1] == [1]
    d = make_seq(PROMPT[:12], 1, "d")
    sched.add(d)
    step(sched, kv)
    assert d.num_cached_tokens == 4, "a's first block survived the eviction"
    run_all(sched, kv, [b, c, d])
    check_all_free(sched)


def test_reset_cache_refused_while_a_block_is_held_then_forgets_every_block():
    sched, kv, a = after_first(PROMPT, 3, num_blocks=12)  # a holds 8 blocks, its 7 full prompt blocks cached
    bm = sched.blocks
    cached_before = dict(bm.cached)
    assert not bm.reset_cache(), "a holds blocks: refused"
    assert bm.cached == cached_before and len(bm.evictable) == 0
    check_invariants(sched, kv)
    run_all(sched, kv, [a])  # 32 of its 33 tokens computed: 8 full blocks cached, all evictable now
    assert len(bm.evictable) == 8 and len(bm.free_blocks) == 3
    assert bm.reset_cache()
    check_invariants(sched, kv)
    assert not bm.cached and not bm.evictable and bm.hash_of == [None] * 12
    assert sorted(bm.free_blocks) == list(range(1, 12)) and bm.num_free == 11
    b = make_seq(PROMPT, 3, "b")  # a's prompt again: nothing of it is found
    sched.add(b)
    assert bm.match(b) == []
    batch, _ = step(sched, kv)
    assert batch.num_new_tokens == [30] and b.num_cached_tokens == 0
    c = make_seq(PROMPT, 3, "c")  # b registered its blocks again: c hits them
    sched.add(c)
    step(sched, kv)
    assert c.num_cached_tokens == 28
    run_all(sched, kv, [a, b, c])
    check_all_free(sched)


def test_a_hit_takes_its_blocks_out_of_the_evictable_pool():
    """Admission counts cached blocks held by no one as taken: they cannot also be evicted for it."""
    sched, kv = sched_of(num_blocks=9)  # 8 usable blocks
    a = make_seq(PROMPT[:24], 1, "a")  # 6 full blocks
    sched.add(a)
    run_all(sched, kv, [a])
    x = make_seq([7] * 6, 2, "x")
    sched.add(x)
    step(sched, kv)  # x holds the 2 uncached blocks
    bm = sched.blocks
    assert len(bm.evictable) == 6 and not bm.free_blocks
    # 25 tokens: 5 cached blocks + 2 new; 6 blocks are free, but 5 of them are its own hits
    c = make_seq(PROMPT[:20] + [8] * 5, 2, "c")
    sched.add(c)
    hits = bm.match(c)
    assert len(hits) == 5 and not bm.can_admit(hits, 25)
    batch, _ = step(sched, kv)
    assert batch.seqs == [x] and c.status is Status.WAITING
    run_all(sched, kv, [x, c])
    assert c.num_cached_tokens == 20
    check_all_free(sched)


# ---------------------------------------------------------------- chunked prefill, preemption, abort
def test_chunked_prefill_after_a_cached_prefix_counts_only_computed_tokens():
    sched, kv = sched_of(budget=6)
    a = make_seq(PROMPT, 2, "a")
    sched.add(a)
    chunks = []
    while not a.output_token_ids:
        batch, _ = step(sched, kv)
        chunks.append(batch.num_new_tokens[0])
    assert chunks == [6, 6, 6, 6, 6]
    b = make_seq(PROMPT[:20] + [8] * 15, 2, "b")  # 20 cached tokens, 15 to compute
    sched.add(b)
    chunks = []
    while not b.output_token_ids:
        batch, _ = step(sched, kv)
        if b in batch.seqs:
            chunks.append(batch.num_new_tokens[batch.seqs.index(b)])
    assert b.num_cached_tokens == 20 and sum(chunks) == 15 and max(chunks) <= 6
    run_all(sched, kv, [a, b])
    check_all_free(sched)


def test_preempting_a_sharer_keeps_the_shared_blocks_for_the_others():
    sched, kv, a = after_first(PROMPT, 6)
    b = make_seq(PROMPT[:16] + [9, 9], 6, "b")
    sched.add(b)
    step(sched, kv)
    shared = list(b.block_ids[:4])
    sched.preempt(b)
    check_invariants(sched, kv)
    assert [sched.blocks.ref_counts[x] for x in shared] == [1, 1, 1, 1] and b.status is Status.WAITING
    sched.preempt(a)
    check_invariants(sched, kv)
    assert set(shared) <= set(sched.blocks.evictable), "freed shared blocks stay cached"
    # both come back and reuse their own blocks, outputs (already generated tokens included) intact
    run_all(sched, kv, [a, b])
    assert sched.stats.num_preemptions == 2
    check_all_free(sched)


def test_abort_of_a_request_whose_blocks_are_shared():
    sched, kv, a = after_first(PROMPT, 8)
    b, c = make_seq(PROMPT[:20] + [4], 8, "b"), make_seq(PROMPT + [5, 5], 8, "c")
    sched.add(b)
    sched.add(c)
    step(sched, kv)
    step(sched, kv)
    sched.finish(a)  # aborted mid-decode: b and c still hold the prefix
    check_invariants(sched, kv)
    step(sched, kv)
    sched.finish(b)
    check_invariants(sched, kv)
    run_all(sched, kv, [c])
    check_all_free(sched)


# ---------------------------------------------------------------- n > 1: wait_for
def test_children_wait_for_the_first_to_compute_the_prompt():
    sched, kv = sched_of(budget=16)
    first = make_seq(PROMPT, 4, "g0")
    kids = [make_seq(PROMPT, 4, f"g{i}", wait_for=first) for i in (1, 2)]
    other = make_seq([7] * 5, 4, "other")
    for s in (first, *kids, other):
        sched.add(s)
    batch, _ = step(sched, kv)
    assert batch.seqs == [first] and batch.num_new_tokens == [16]
    batch, _ = step(sched, kv)
    assert batch.seqs == [first, other] and batch.num_new_tokens == [14, 2], "held-back children let a later request go ahead"
    assert [s.status for s in kids] == [Status.WAITING] * 2 and list(sched.waiting) == kids
    batch, _ = step(sched, kv)  # the first child has computed its prompt: its children start after it
    assert batch.seqs == [other, *kids] and batch.num_new_tokens == [3, 2, 2]
    assert [s.num_cached_tokens for s in kids] == [28, 28]
    run_all(sched, kv, [first, *kids, other])
    check_all_free(sched)


@pytest.mark.parametrize("caching", [True, False])
def test_children_go_normally_when_the_first_is_aborted_or_caching_is_off(caching):
    sched, kv = sched_of(budget=20, caching=caching)
    first = make_seq(PROMPT, 4, "g0")
    kid = make_seq(PROMPT, 4, "g1", wait_for=first)
    sched.add(first)
    sched.add(kid)
    batch, _ = step(sched, kv)
    if caching:
        assert batch.seqs == [first]
        sched.finish(first)  # aborted before its prompt was done: the child goes
        sched.add(kid2 := make_seq(PROMPT, 4, "g2", wait_for=first))
        batch, _ = step(sched, kv)
        assert kid2 in batch.seqs
    else:  # no cache to wait for: the child is admitted as soon as the budget allows
        batch, _ = step(sched, kv)
        assert batch.seqs == [first, kid]
    assert kid in batch.seqs and kid.wait_for is None
    run_all(sched, kv, [kid, kid2] if caching else [first, kid])
    check_all_free(sched)


def test_a_request_for_prompt_logprobs_computes_its_whole_prompt():
    """Cached prompt tokens have no logits: such a request takes no hits (its blocks are still cached)."""
    from ingot.engine.sequence import Sequence
    from ingot.sampling_params import SamplingParams

    sched, kv, a = after_first(PROMPT, 2)
    b = Sequence("b", None, PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=1), detok=None)
    sched.add(b)
    batch, _ = step(sched, kv)
    assert batch.seqs == [b] and batch.num_new_tokens == [30] and b.num_cached_tokens == 0
    c = make_seq(PROMPT, 2, "c")
    sched.add(c)
    step(sched, kv)
    assert c.num_cached_tokens == 28
    run_all(sched, kv, [a, b, c])
    check_all_free(sched)
