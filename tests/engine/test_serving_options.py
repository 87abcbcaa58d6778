"""Serving options: ``Engine.reset_prefix_cache`` (and ``LLM.reset_prefix_cache``), allowed
only while no request is in flight, and engines built with prefix caching or overlap
scheduling off, on a tiny random checkpoint (greedy fp32); the reference for tokens is
an engine built with the other setting."""

from __future__ import annotations

import random

import pytest

from ingot import LLM
from ingot.engine.engine_loop import EngineDeadError
from ingot.sampling_params import SamplingParams
from tests.engine.fake_steps import check_all_free, check_invariants
from tests.helpers import write_tiny_checkpoint

BS = 4
rng = random.Random(3)
PROMPT = [rng.randrange(5, 380) for _ in range(30)]  # 7 full blocks of 4, and 2 tokens
PROMPTS = [PROMPT, PROMPT[:13] + [7, 8, 9], [rng.randrange(5, 380) for _ in range(21)]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("options") / "llama", "llama"))


def engine_of(path, **kw):
    kw = {"block_size": BS, "max_num_seqs": 8, **kw}
    return LLM(path, dtype="float32", device="cpu", show_progress=False, **kw).engine


def greedy(n: int = 6, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def run(engine, prompts, tag: str, **params):
    """Run ``prompts`` together to completion: (tokens, cached tokens) per prompt, and
    whether any step was left in flight (overlap scheduling at work)."""
    seqs = [engine.add_request(p, greedy(**params), f"{tag}-{i}", stream=False) for i, p in enumerate(prompts)]
    overlapped = False
    while engine.has_unfinished():
        engine.step()
        overlapped |= engine._inflight is not None
        check_invariants(engine.scheduler)
    check_all_free(engine.scheduler)
    return [list(s.output_token_ids) for s in seqs], [s.num_cached_tokens for s in seqs], overlapped


def test_reset_prefix_cache_forgets_what_a_repeated_prompt_would_hit(tiny):
    engine = engine_of(tiny)
    first, cached, _ = run(engine, [PROMPT], "a")
    assert cached == [0]
    again, cached, _ = run(engine, [PROMPT], "b")
    assert cached == [28] and again == first, "without a reset the repeated prompt hits its 7 full blocks"
    assert engine.reset_prefix_cache() is True
    blocks = engine.scheduler.blocks
    assert not blocks.cached and not blocks.evictable and blocks.num_free == blocks.num_blocks - 1
    queries, hits = engine.stats().prefix_cache_queries, engine.stats().prefix_cache_hits
    after, cached, _ = run(engine, [PROMPT], "c")
    assert cached == [0] and after == first
    assert engine.stats().prefix_cache_queries - queries == 30 and engine.stats().prefix_cache_hits == hits
    _, cached, _ = run(engine, [PROMPT], "d")
    assert cached == [28], "the cache fills again after a reset"


def test_reset_is_refused_while_requests_are_in_flight(tiny):
    engine = engine_of(tiny)
    run(engine, [PROMPT], "warm")  # its blocks stay cached
    cached = dict(engine.scheduler.blocks.cached)
    seq = engine.add_request(PROMPTS[2], greedy(), "busy", stream=False)
    engine.step()
    assert engine.reset_prefix_cache() is False
    assert engine.scheduler.blocks.caching
    assert all(engine.scheduler.blocks.cached.get(h) == b for h, b in cached.items()), "nothing was forgotten"
    while engine.has_unfinished():
        engine.step()
    assert seq.finished
    _, hit, _ = run(engine, [PROMPT], "again")
    assert hit == [28], "the refused reset left the cache as it was"


def test_a_step_in_flight_for_ended_requests_is_read_back_first(tiny):
    """Overlap: the abort of a request while its next step is queued leaves that step in flight;
    with no request left the engine counts as idle, and the step is read back before the reset."""
    engine = engine_of(tiny)  # overlap scheduling on (the default)
    engine.add_request(PROMPT, greedy(), "x", stream=False)
    engine.step()
    engine.step()
    assert engine._inflight is not None
    engine.abort("x")
    assert not engine.requests and engine.has_unfinished()
    assert engine.reset_prefix_cache() is True
    assert not engine.has_unfinished() and not engine.scheduler.blocks.cached
    check_all_free(engine.scheduler)


def test_overlap_scheduling_keeps_the_greedy_tokens(tiny):
    serial = engine_of(tiny, overlap_scheduling=False, enable_prefix_caching=False)
    want, _, overlapped = run(serial, PROMPTS, "ref", n=9)
    assert not overlapped, "a serial engine never leaves a step in flight"
    engine = engine_of(tiny)  # overlap on
    tokens, _, overlapped = run(engine, PROMPTS, "on", n=9)
    assert overlapped and tokens == want


def test_prefix_caching_off_looks_nothing_up(tiny):
    engine = engine_of(tiny, overlap_scheduling=False, enable_prefix_caching=False)
    blocks = engine.scheduler.blocks
    assert not blocks.caching
    want, _, _ = run(engine, [PROMPT], "a")
    for tag in ("off1", "off2"):
        tokens, cached, _ = run(engine, [PROMPT], tag)
        assert tokens == want and cached == [0] and not blocks.cached and not blocks.evictable
    assert engine.stats().prefix_cache_queries == 0, "with caching off nothing is looked up"
    cached_engine = engine_of(tiny, overlap_scheduling=False)
    run(cached_engine, [PROMPT], "on1")
    tokens, cached, _ = run(cached_engine, [PROMPT], "on2")
    assert cached == [28] and tokens == want


def test_llm_reset_prefix_cache_runs_in_the_engine_loop(tiny):
    llm = LLM(tiny, dtype="float32", device="cpu", show_progress=False, block_size=BS)
    try:
        assert llm.reset_prefix_cache() is True  # before the loop ever ran
        first = llm.generate([PROMPT], greedy(), use_tqdm=False)[0]
        again = llm.generate([PROMPT], greedy(), use_tqdm=False)[0]
        assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 28)
        assert llm.reset_prefix_cache() is True
        after = llm.generate([PROMPT], greedy(), use_tqdm=False)[0]
        assert after.num_cached_tokens == 0 and after.outputs[0].token_ids == first.outputs[0].token_ids
        stream = llm.stream(PROMPTS[2], greedy(230))  # 251 of the 256 positions: hundreds of steps
        next(stream)  # in flight
        assert llm.reset_prefix_cache() is False
        stream.close()  # aborts it, before the next call runs
        assert llm.reset_prefix_cache() is True
    finally:
        llm.shutdown()
    with pytest.raises(EngineDeadError):
        llm.reset_prefix_cache()
