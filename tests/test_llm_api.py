"""The LLM API on a tiny random checkpoint: outputs, stops, streaming, bad input isolation."""

from __future__ import annotations

import pytest

from ingot import LLM, RequestError, SamplingError, SamplingParams
from tests.helpers import write_tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    return LLM(str(path), dtype="float32", device="cpu", show_progress=False, max_num_seqs=8)


def greedy(n: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def test_generate_shapes_and_lengths(llm):
    outs = llm.generate(["hello world", "the quick brown fox"], greedy(9))
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 9]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    tok = llm.get_tokenizer()
    for o in outs:
        assert o.prompt_token_ids == tok.encode(o.prompt)
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids)


def test_token_id_prompts_and_single_list(llm):
    ids = llm.get_tokenizer().encode("hello world")
    a = llm.generate(ids, greedy())[0]
    b = llm.generate("hello world", greedy())[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_bad_requests_fail_alone(llm):
    good = "hello world"
    outs = llm.generate(["", good, [10**6], "x " * 400, good], greedy())
    assert len(outs) == 5
    assert [o.error is not None for o in outs] == [True, False, True, True, False]
    assert "empty" in outs[0].error and "out of range" in outs[2].error and "max_model_len" in outs[3].error
    assert outs[1].outputs[0].token_ids == outs[4].outputs[0].token_ids
    assert len(outs[1].outputs[0].token_ids) == 12


def test_invalid_sampling_values_raise_clearly():
    with pytest.raises(SamplingError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(SamplingError, match="top_p"):
        SamplingParams(top_p=0)


def test_stop_token_and_stop_string(llm):
    base = llm.generate("hello world", greedy(12))[0].outputs[0]
    stop_tok = base.token_ids[4]
    first = base.token_ids.index(stop_tok)
    out = llm.generate("hello world", greedy(12, stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == base.token_ids[: first + 1]
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if stop.strip():
        out = llm.generate("hello world", greedy(12, stop=[stop]))[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == text[: text.index(stop)]


def test_stream_deltas_add_up(llm):
    params = greedy(10)
    deltas = [o.delta for o in llm.stream("hello world", params)]
    full = llm.generate("hello world", params)[0].outputs[0].text
    assert "".join(deltas) == full
    assert len(deltas) == 10


def test_generate_detokenizes_once_at_the_end(llm, monkeypatch):
    """generate() reads text only at the end: its tokens are decoded once, in one batch for
    the sequences that finish together; stop strings still need the text of every step."""
    import ingot.engine.stop_rules as stop_rules

    calls = []
    real = stop_rules.add_tokens

    def counting(detoks, token_ids, final=False):
        calls.append((len(detoks), final))
        return real(detoks, token_ids, final)

    monkeypatch.setattr(stop_rules, "add_tokens", counting)
    outs = llm.generate(["hello world", "the quick brown fox"], greedy(9))
    assert [c for c in calls if c[0]] == [(2, True)]
    tok = llm.get_tokenizer()
    for o in outs:
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids)
    assert outs[0].outputs[0].text == "".join(o.delta for o in llm.stream("hello world", greedy(9)))
    calls.clear()
    llm.generate("hello world", greedy(9, stop=["never appears \u2603"]))
    assert [c for c in calls if c[0]] == [(1, False)] * 9
    # an aborted deferred request still gets the text of the tokens it has
    seq = llm.engine.add_request("hello world", greedy(9), stream=False)
    for _ in range(4):
        llm.engine.step()
    assert seq.output_token_ids and seq.text == ""
    llm.engine.abort(seq.request_id)
    # (the final text leaves out a trailing partial character, as streaming does)
    assert seq.finish_reason == "abort" and seq.text == tok.decode(seq.output_token_ids).rstrip("\ufffd")
    llm.engine.requests.pop(seq.request_id, None)


def test_chat_uses_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], greedy(4))[0]
    tok = llm.get_tokenizer()
    expected = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert out.prompt_token_ids == expected
    with pytest.raises(RequestError):
        llm.engine.add_request("", None)


def test_seeded_sampling_reproducible_in_any_batch(llm):
    p = SamplingParams(temperature=1.0, seed=123, max_tokens=10, ignore_eos=True)
    alone = llm.generate("hello world", p)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    batch = llm.generate(["the fox", "hello world", "def f(x)"], [other, p, other])
    assert batch[1].outputs[0].token_ids == alone


def test_logprobs(llm):
    out = llm.generate("hello world", greedy(3, logprobs=2))[0].outputs[0]
    assert len(out.logprobs) == 3
    tok_ = llm.get_tokenizer()
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) >= 2
        assert lp[tok].logprob == max(v.logprob for v in lp.values())  # greedy picks the most likely token
        assert lp[tok].rank == 1 and sorted(v.rank for v in lp.values()) == [1, 2]
        assert all(v.decoded_token == tok_.decode([t]) for t, v in lp.items())
    assert out.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)))
