"""No fault loses other work: bad input, failures inside a step, and interrupts fail (or end)
only their own requests, leave nothing registered and no KV block held, and the engine goes on."""

from __future__ import annotations

import _thread
import queue
import threading
import time

import pytest

from ingot import LLM, SamplingParams
from tests.engine.test_many_callers import assert_clean
from tests.helpers import write_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("faults") / "llama", "llama")
    llm = LLM(str(path), dtype="float32", device="cpu", show_progress=False, max_num_seqs=16, num_kv_blocks=96)
    yield llm
    llm.shutdown()


def tokens(outs) -> list:
    return [o.outputs[0].token_ids for o in outs]


def test_lone_surrogate_prompt_is_encoded_with_replacement(llm):
    outs = llm.generate(["hello world", "\udcff bad", "the fox"], GREEDY)
    assert [o.error for o in outs] == [None, None, None]
    assert outs[1].prompt_token_ids == llm.get_tokenizer().encode("\ufffd bad")
    assert tokens(outs) == tokens(llm.generate(["hello world", "\ufffd bad", "the fox"], GREEDY))
    chat = llm.chat([{"role": "user", "content": "hi \ud800 there"}], GREEDY)[0]
    assert chat.error is None and chat.prompt_token_ids == llm.chat([{"role": "user", "content": "hi \ufffd there"}], GREEDY)[0].prompt_token_ids
    assert_clean(llm)


def test_non_prompts_raise_a_clear_type_error(llm):
    for bad in (123, None, 4.5):
        with pytest.raises(TypeError, match="prompts must be"):
            llm.generate(bad)
    outs = llm.generate(["ok", 123, {"prompt": "ok"}, {"bogus": 1}], GREEDY)
    assert [o.error is None for o in outs] == [True, False, True, False]
    assert "a prompt must be" in outs[1].error and "bogus" in outs[3].error
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert_clean(llm)


def test_failing_stop_check_fails_that_request_alone(llm, monkeypatch):
    import ingot.engine.stop_rules as stop_rules

    real = stop_rules.find_stop

    def find_stop(text, stops, already):
        if "BOOM" in stops:
            raise RuntimeError("stop check exploded")
        return real(text, stops, already)

    monkeypatch.setattr(stop_rules, "find_stop", find_stop)
    good = llm.generate(["hello world", "the fox"], GREEDY)
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=8, stop=["BOOM"]), GREEDY]
    outs = llm.generate(["hello world", "lazy dog", "the fox"], params)
    assert outs[1].error and "stop check exploded" in outs[1].error and outs[1].outputs[0].finish_reason == "error"
    assert tokens([outs[0], outs[2]]) == tokens(good)
    assert_clean(llm)


def test_failing_detokenizer_fails_that_request_alone(llm, monkeypatch):
    import ingot.engine.stop_rules as stop_rules

    victim = llm.get_tokenizer().encode("lazy dog")
    real = stop_rules.add_tokens

    def add_tokens(detoks, token_ids, final=False):
        if any(d.ids[: len(victim)] == victim for d in detoks):
            raise ValueError("cannot decode")
        return real(detoks, token_ids, final)

    stream_params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=["never seen"])
    alone = llm.generate(["hello world", "the fox"], stream_params)
    monkeypatch.setattr(stop_rules, "add_tokens", add_tokens)
    outs = llm.generate(["hello world", "lazy dog", "the fox"], stream_params)
    assert outs[1].error and "cannot decode" in outs[1].error
    assert [o.error for o in (outs[0], outs[2])] == [None, None]
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in (outs[0], outs[2])] == [
        (o.outputs[0].token_ids, o.outputs[0].text) for o in alone]
    assert_clean(llm)


def test_failing_sampler_row_fails_that_request_alone(llm, monkeypatch):
    from ingot.runner.sampler import Sampler

    real = Sampler._sample

    def sample(self, x, rows, which):
        if any(rows[i].params.top_k == 77 for i in which):
            raise RuntimeError("sampler exploded")
        return real(self, x, rows, which)

    monkeypatch.setattr(Sampler, "_sample", sample)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    bad = SamplingParams(temperature=0.8, top_k=77, max_tokens=6, ignore_eos=True)
    alone = llm.generate(["hello world", "the fox"], [seeded, GREEDY])
    outs = llm.generate(["hello world", "lazy dog", "the fox"], [seeded, bad, GREEDY])
    assert outs[1].error and "sampler exploded" in outs[1].error
    assert tokens([outs[0], outs[2]]) == tokens(alone)
    assert_clean(llm)


def test_failing_model_step_fails_its_batch_and_the_engine_goes_on(llm, monkeypatch):
    runner = llm.engine.executor
    real = runner.launch
    calls = {"n": 0}

    def launch(batch, eos, feed=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fell over")
        return real(batch, eos, feed)

    monkeypatch.setattr(runner, "launch", launch)
    outs = llm.generate(["hello world", "the fox"], GREEDY)
    assert all(o.error and "device fell over" in o.error for o in outs)
    assert_clean(llm)
    monkeypatch.undo()
    again = llm.generate(["hello world", "the fox"], GREEDY)
    assert [o.error for o in again] == [None, None] and all(len(t) == 8 for t in tokens(again))


def test_interrupted_generate_leaves_nothing_behind(llm, monkeypatch):
    """Ctrl-C while generate waits (a KeyboardInterrupt raised by its wait for outputs, as the
    signal does there) aborts its requests: nothing stays registered, no block held."""
    import ingot.llm as llm_mod

    reference = tokens(llm.generate(["hello world", "the fox"], GREEDY))

    class Interrupted(queue.SimpleQueue):
        waits = 0

        def get(self, block=True, timeout=None):
            Interrupted.waits += 1
            if Interrupted.waits == 5:  # the fifth output: the requests are running
                raise KeyboardInterrupt
            return super().get(block, timeout)

    monkeypatch.setattr(llm_mod.queue, "SimpleQueue", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["lazy dog quick"] * 12, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, stop=["x"]))
    monkeypatch.undo()
    assert Interrupted.waits > 5, "the abort was confirmed through the same queue"
    assert_clean(llm)
    assert tokens(llm.generate(["hello world", "the fox"], GREEDY)) == reference


def test_ctrl_c_signal_during_generate_is_an_interrupt(llm):
    """The real signal path: SIGINT's KeyboardInterrupt lands in generate's wait, which is
    interruptible, and the call ends cleanly."""
    timer = threading.Timer(0.3, _thread.interrupt_main)  # what Ctrl-C does
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    timer.start()
    try:
        llm.generate(["lazy dog quick"] * 48, params)  # seconds on 2 cores, far past the timer
        finished = True
    except KeyboardInterrupt:
        finished = False
    timer.join()
    if finished:  # the machine was fast enough to finish first; the interrupt may still be pending
        try:
            time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    assert_clean(llm)


def test_an_engine_thread_that_cannot_start_fails_requests_instead_of_hanging(tmp_path, monkeypatch):
    """If the loop thread dies before its first step (binding the GPU, say), the requests
    waiting for it get an error output and later calls fail clearly; nothing hangs."""
    from ingot.engine.engine_loop import EngineDeadError

    def broken():
        raise RuntimeError("no such GPU")

    path = write_tiny_checkpoint(tmp_path / "llama", "llama")
    llm = LLM(str(path), dtype="float32", device="cpu", show_progress=False)
    monkeypatch.setattr(llm.engine.executor, "make_current", broken)
    (out,) = llm.generate("hello world", GREEDY)
    assert out.error and "no such GPU" in out.error
    with pytest.raises(EngineDeadError, match="no such GPU"):
        llm.generate("hello world", GREEDY)
    llm.shutdown()
