"""One LLM shared by many callers: threads, interleaved streams, open and abandoned streams.

Each case is checked against the same requests run alone, one at a time, on the same engine
(greedy decoding and per-request seeds make a request's tokens independent of its batch).
"""

from __future__ import annotations

import gc
import random
import threading
import time

import pytest

from ingot import LLM, SamplingParams
from tests.helpers import write_tiny_checkpoint

WORDS = "the quick brown fox jumps over lazy dog hello world tokens return def".split()


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("callers") / "llama", "llama")
    llm = LLM(str(path), dtype="float32", device="cpu", show_progress=False, max_num_seqs=16, num_kv_blocks=96)
    yield llm
    llm.shutdown()


def wait_idle(llm: LLM, timeout: float = 10.0) -> None:
    """Until the engine holds no request (aborts are applied by the loop thread)."""
    deadline = time.monotonic() + timeout
    while llm.engine.requests and time.monotonic() < deadline:
        time.sleep(0.01)


def assert_clean(llm: LLM) -> None:
    wait_idle(llm)
    sched = llm.engine.scheduler
    assert not llm.engine.requests and not sched.waiting and not sched.running
    assert sched.blocks.num_free == sched.blocks.num_blocks - 1, "KV blocks leaked"


def mixed_requests(seed: int, count: int) -> list[tuple[str, SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
        kind = i % 4
        if kind == 0:
            params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=True)
        elif kind == 1:  # seeded sampling: the same tokens in any batch
            params = SamplingParams(temperature=0.9, top_p=0.9, seed=rng.randint(0, 1000), max_tokens=rng.randint(4, 20))
        elif kind == 2:
            params = SamplingParams(temperature=0.0, max_tokens=16, stop=[rng.choice(WORDS)], logprobs=2)
        else:
            params = SamplingParams(n=2, temperature=0.7, seed=rng.randint(0, 1000), max_tokens=rng.randint(2, 12))
        out.append((prompt, params))
    return out


def signature(out) -> list:
    return [(c.token_ids, c.text, c.finish_reason) for c in out.outputs]


def test_eight_threads_of_twenty_mixed_requests(llm):
    work = [mixed_requests(seed, 20) for seed in range(8)]
    alone = [[signature(llm.generate(p, s, use_tqdm=False)[0]) for p, s in reqs] for reqs in work]
    results: list = [None] * 8
    errors: list = []

    def caller(k: int) -> None:
        try:
            prompts, params = zip(*work[k])
            results[k] = [signature(o) for o in llm.generate(list(prompts), list(params), use_tqdm=False)]
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert results == alone
    assert_clean(llm)


def test_interleaved_streams_reassemble_exactly(llm):
    pa = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    pb = SamplingParams(temperature=0.8, seed=5, max_tokens=14, ignore_eos=True)
    full_a = llm.generate("the quick brown fox", pa)[0].outputs[0]
    full_b = llm.generate("hello world", pb)[0].outputs[0]
    a, b = llm.stream("the quick brown fox", pa), llm.stream("hello world", pb)
    outs: dict[str, list] = {"a": [], "b": []}
    live = {"a": a, "b": b}
    while live:
        for name in list(live):
            try:
                outs[name].append(next(live[name]))
            except StopIteration:
                del live[name]
    for name, full in (("a", full_a), ("b", full_b)):
        chunks = outs[name]
        assert chunks[-1].finished and chunks[-1].outputs[0].text == full.text
        assert "".join(c.delta for c in chunks) == full.text
        assert [t for c in chunks for t in c.outputs[0].delta_token_ids] == full.token_ids
    assert_clean(llm)


def test_open_stream_does_not_hold_up_generate_and_loses_nothing(llm):
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    expected = llm.generate("lazy dog", long)[0].outputs[0].text
    stream = llm.stream("lazy dog", long)
    first = next(stream)  # open, then left alone while generate runs
    short = llm.generate(["hello world", "def"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 3 for o in short)
    rest = list(stream)
    assert first.delta + "".join(c.delta for c in rest) == expected
    assert rest[-1].finished
    assert_clean(llm)


@pytest.mark.parametrize("how", ["close", "gc", "break"])
def test_abandoned_stream_is_aborted_and_frees_its_blocks(llm, how):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    stream = llm.stream("the quick brown fox", params)
    for _ in range(3):
        next(stream)
    assert llm.engine.requests
    if how == "close":
        stream.close()
    elif how == "gc":
        del stream
        gc.collect()
    else:
        for i, _ in enumerate(stream):
            if i == 2:
                break
        stream.close()
    assert_clean(llm)
    after = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(after.outputs[0].token_ids) == 4


def test_abort_from_another_thread_ends_the_stream(llm):
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    stream = llm.stream("hello world", params)
    first = next(stream)
    threading.Timer(0.05, llm._loop.abort, args=(first.request_id,)).start()
    last = list(stream)[-1]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert 0 < len(last.outputs[0].token_ids) < 400
    # every complete character of the tokens it got (a trailing partial one is dropped)
    full = llm.get_tokenizer().decode(last.outputs[0].token_ids, skip_special_tokens=True)
    assert last.outputs[0].text == full.rstrip("\ufffd")
    assert_clean(llm)
