"""Scheduler and block manager: chunking, admission, preemption, block accounting."""

from __future__ import annotations

import pytest

from ingot.engine.block_manager import BlockManager
from ingot.engine.scheduler import Scheduler
from ingot.engine.sequence import Sequence, Status
from ingot.sampling_params import SamplingParams


def seq(n_prompt: int, rid: str = "r") -> Sequence:
    return Sequence(rid, None, list(range(3, 3 + n_prompt)), SamplingParams(max_tokens=100), detok=None)


def advance(batch, token: int = 7) -> None:
    """What the engine does after a step: count computed tokens, append sampled tokens."""
    for i, s in enumerate(batch.seqs):
        sampled = batch.samples(i)
        s.num_computed_tokens += batch.num_new_tokens[i]
        if sampled:
            s.output_token_ids.append(token)


def test_block_zero_is_never_handed_out():
    bm = BlockManager(num_blocks=5, block_size=4)
    s = seq(16)
    bm.grow(s, 16)
    assert sorted(s.block_ids) == [1, 2, 3, 4] and bm.num_free == 0
    bm.free(s)
    assert bm.num_free == 4 and list(s.block_ids) == []


def test_long_prompt_is_chunked_then_decodes():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    s = seq(23)
    sched.add(s)
    chunks = []
    while True:
        b = sched.schedule()
        assert b.is_prefill
        chunks.append(b.num_new_tokens[0])
        advance(b)
        if s.output_token_ids:
            break
    assert chunks == [10, 10, 3]
    b = sched.schedule()
    assert not b.is_prefill and b.num_new_tokens == [1]
    assert len(s.block_ids) == 6  # 24 tokens in blocks of 4


def test_prefill_budget_shared_and_seq_limit():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=12)
    a, b, c = seq(5, "a"), seq(5, "b"), seq(5, "c")
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert [x.request_id for x in batch.seqs] == ["a", "b"]  # max_num_seqs=2
    assert batch.num_new_tokens == [5, 5]
    assert c.status is Status.WAITING


def test_request_waits_until_blocks_free():
    sched = Scheduler(BlockManager(5, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq(12, "a"), seq(8, "b")
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [x.request_id for x in batch.seqs] == ["a"]  # b needs 2 blocks, 1 free
    advance(batch)
    sched.finish(a)
    batch = sched.schedule()
    assert [x.request_id for x in batch.seqs] == ["b"]


def test_preemption_evicts_newest_and_recomputes():
    sched = Scheduler(BlockManager(5, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq(8, "a"), seq(7, "b")
    sched.add(a)
    sched.add(b)
    advance(sched.schedule())  # both prefilled: a has 2 blocks, b 2 blocks, 0 free
    assert sched.blocks.num_free == 0
    batch = sched.schedule()  # decode: a needs a 3rd block at token 9 -> b is preempted
    assert not batch.is_prefill
    assert [x.request_id for x in batch.seqs] == ["a"]
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and list(b.block_ids) == []
    assert b.output_token_ids == [7], "generated tokens are kept and recomputed, never dropped"
    assert sched.waiting[0] is b and sched.stats.num_preemptions == 1
    advance(batch)
    sched.finish(a)
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs == [b] and batch.num_new_tokens == [8]
    assert batch.samples(0)


def test_tokens_slices_prompt_and_output_without_joining():
    s = seq(5)  # prompt 3..7
    s.output_token_ids = [100, 101, 102]
    whole = s.prompt_token_ids + s.output_token_ids
    for start, end in [(0, 5), (2, 5), (5, 8), (7, 8), (3, 7), (0, 8)]:
        assert s.tokens(start, end) == whole[start:end]


def test_a_prompt_that_cannot_fit_yet_waits_instead_of_starving_decodes():
    """8 usable blocks of 4; a (20 tokens) is decoding in 6 blocks, b (20 tokens) needs 5 more.
    b is not admitted on its first chunk alone: it waits until a ends, and a keeps decoding
    (admitted, b used to run out of blocks mid-prompt, preempt itself and be re-admitted,
    in prefill steps that always go first, forever)."""
    sched = Scheduler(BlockManager(9, 4), max_num_seqs=4, max_num_batched_tokens=3)
    a, b = seq(20, "a"), seq(20, "b")
    a.params = SamplingParams(max_tokens=6)
    sched.add(a)
    while not a.output_token_ids:
        advance(sched.schedule())
    sched.add(b)
    kinds = []
    while not a.finished:
        batch = sched.schedule()
        assert batch.seqs == [a] and not batch.is_prefill and b.status is Status.WAITING
        advance(batch)
        kinds.append(batch.is_prefill)
        if len(a.output_token_ids) == a.params.max_tokens:
            sched.finish(a)
    assert len(kinds) == 5 and sched.stats.num_preemptions == 0
    batch = sched.schedule()
    assert batch.seqs == [b] and batch.num_new_tokens == [3]


def test_prefill_waves_hold_small_prompts_while_decoding(monkeypatch):
    """With prefill_wave_tokens=12: nothing decodes at first, so ``a`` is admitted at once;
    then ``b`` (5 tokens) waits while ``a`` decodes, until ``c`` brings the waiting tokens to
    12 and both are admitted in one prefill step (the hold bound lifted: one running sequence
    alone would not hold anything)."""
    monkeypatch.setattr(Scheduler, "max_wave_wait", lambda self: Scheduler.MAX_WAVE_WAIT_STEPS)
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64, prefill_wave_tokens=12)
    a, b, c = seq(5, "a"), seq(5, "b"), seq(7, "c")
    sched.add(a)
    first = sched.schedule()
    assert first.is_prefill and first.seqs == [a]
    advance(first)
    sched.add(b)
    for _ in range(3):
        step = sched.schedule()
        assert not step.is_prefill and step.seqs == [a]  # b (5 < 12 tokens) sits out
        advance(step)
    sched.add(c)
    wave = sched.schedule()
    assert wave.is_prefill and [s.request_id for s in wave.seqs] == ["b", "c"] and wave.num_new_tokens == [5, 7]


@pytest.mark.parametrize("running, bound", [(1, 0), (7, 0), (16, 2), (300, 32)])
def test_a_held_prompt_is_admitted_after_the_wait_bound(running, bound):
    """A prompt short of a wave sits out one decode step per 8 running sequences, at most 32."""
    sched = Scheduler(BlockManager(8192, 4), max_num_seqs=running + 1, max_num_batched_tokens=4096,
                      prefill_wave_tokens=100_000)
    for i in range(running):
        sched.add(seq(5, f"r{i}"))
    first = sched.schedule()
    assert first.is_prefill and len(first.seqs) == running  # nothing decodes yet: no wave needed
    advance(first)
    b = seq(5, "b")
    sched.add(b)
    decodes = 0
    while True:
        step = sched.schedule()
        if step.is_prefill:
            break
        decodes += 1
        advance(step)
    assert step.seqs == [b] and decodes == bound


def test_prefill_waves_keep_greedy_outputs(tmp_path, monkeypatch):
    """The same greedy tokens with and without waves (only the batches differ)."""
    monkeypatch.setattr(Scheduler, "max_wave_wait", lambda self: Scheduler.MAX_WAVE_WAIT_STEPS)  # hold at 4 running
    from ingot import LLM
    from tests.helpers import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "llama", "llama")
    prompts = [" ".join(["word"] * (3 + 7 * i % 23)) for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 5 * i % 17, ignore_eos=True) for i in range(12)]

    def run(wave: int) -> list:
        with LLM(str(path), dtype="float32", device="cpu", show_progress=False, max_num_seqs=4, prefill_wave_tokens=wave) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert llm.engine.stats().prefill_steps > 0
            return [o.outputs[0].token_ids for o in outs], llm.engine.stats().prefill_steps

    (plain, plain_steps), (waved, waved_steps) = run(0), run(40)
    assert waved == plain
    assert waved_steps < plain_steps
