"""logit_bias, allowed_token_ids and bad_words through the engine on a tiny model: greedy
output obeys them (overlap scheduling on), n-gram speculation gives plain decoding's tokens
with them, bad words are tokenized as vLLM does, and ids outside the vocabulary are refused
when the request is processed."""

from __future__ import annotations

import pytest

from ingot import LLM, SamplingParams
from ingot.engine.request import RequestError
from tests.helpers import TINY, write_tiny_checkpoint

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# prompts that end in a repeated token: the tiny model repeats it, and the n-gram lookup drafts it
PROMPTS = ["hellollollollollo", "def f(x): return xxxxxx", "hello world hello world hello"]
VOCAB = TINY["vocab_size"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("rules") / "qwen2", "qwen2")


def engine(path, spec=None) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", show_progress=False, speculative_config=spec)


@pytest.fixture(scope="module")
def llm(tiny):
    with engine(tiny) as llm:
        yield llm


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 16, "ignore_eos": True, **kw})


def tokens(llm, params, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def contains(ids: list[int], word: list[int]) -> bool:
    return any(ids[i : i + len(word)] == word for i in range(len(ids) - len(word) + 1))


def test_bad_words_are_tokenized_as_vllm_does(llm):
    tok = llm.get_tokenizer()
    params = SamplingParams(bad_words=["tokens", " lazy", "hello"])
    llm.engine.inputs.check_params(params)
    # "tokens" and " tokens": as many tokens, another first one (both kept); " lazy" is taken
    # as "lazy" and its spaced form is one token; " hello" is longer than "hello" (dropped)
    assert tok.encode("lazy", add_special_tokens=False) != tok.encode(" lazy", add_special_tokens=False)
    assert len(tok.encode(" hello", add_special_tokens=False)) != len(tok.encode("hello", add_special_tokens=False))
    expected = [tok.encode(w, add_special_tokens=False) for w in ("tokens", " tokens", "lazy", "hello")]
    assert expected[0][0] != expected[1][0] and len(expected[0]) == len(expected[1])
    assert params.bad_words_token_ids == expected and params.has_token_rules


def test_bad_words_never_appear_though_the_plain_output_has_them(llm):
    tok = llm.get_tokenizer()
    plain = tokens(llm, greedy())
    words = sorted({tok.decode(ids[:3]) for ids in plain})  # words the plain outputs begin with
    params = greedy(bad_words=words)
    got = tokens(llm, params)  # (processing the request tokenized its bad words)
    assert params.bad_words_token_ids and all(len(w) > 1 for w in params.bad_words_token_ids)
    for before, after in zip(plain, got):
        assert any(contains(before, w) for w in params.bad_words_token_ids)
        assert not any(contains(after, w) for w in params.bad_words_token_ids), (words, after)
        assert len(after) == 16


def test_allowed_token_ids_and_logit_bias(llm):
    allowed = [5, 40, 77, 120, 300, VOCAB - 1]
    for params in (greedy(allowed_token_ids=allowed), greedy(allowed_token_ids=allowed, temperature=1.0, seed=3)):
        for out in tokens(llm, params):
            assert set(out) <= set(allowed) and len(out) == 16
    assert tokens(llm, greedy(logit_bias={77: 100.0}), PROMPTS[:1]) == [[77] * 16]
    # the raw logprobs: the biased token's is what the plain request saw
    biased = llm.generate(PROMPTS[0], greedy(logit_bias={77: 100.0}, logprobs=0, max_tokens=1), use_tqdm=False)
    plain = llm.generate(PROMPTS[0], greedy(logprobs=20, max_tokens=1), use_tqdm=False)
    lp = biased[0].outputs[0].logprobs[0][77].logprob
    assert lp < max(v.logprob for v in plain[0].outputs[0].logprobs[0].values())


def test_speculation_gives_plain_decodings_tokens(tiny, llm):
    tok = llm.get_tokenizer()
    words = sorted({tok.decode(ids[:3]) for ids in tokens(llm, greedy())})
    cases = [greedy(bad_words=words), greedy(bad_words=words, logit_bias={317: -5.0, 174: -5.0}),
             greedy(allowed_token_ids=list(range(60, 330)), bad_words=words)]
    plain = [tokens(llm, p) for p in cases]
    with engine(tiny, SPEC) as spec:
        got = [tokens(spec, p) for p in cases]
        stats = spec.engine.stats()
    assert got == plain
    assert stats.spec_decode_num_accepted_tokens > 10
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens, "some drafts were refused"


@pytest.mark.parametrize("kw, field, ids", [
    (dict(logit_bias={VOCAB: 1.0, 3: 1.0, -1: 2.0}), "logit_bias", f"[{VOCAB}, -1]"),
    (dict(allowed_token_ids=[1, 2, VOCAB + 7]), "allowed_token_ids", f"[{VOCAB + 7}]"),
])
def test_ids_out_of_the_vocabulary_are_refused(llm, kw, field, ids):
    with pytest.raises(RequestError) as info:
        llm.engine.inputs.check_params(SamplingParams(**kw))
    message = str(info.value)
    assert info.value.param == field and message.startswith(field)
    assert ids in message and f"size is {VOCAB}" in message
    out = llm.generate(["hello", "world"], [SamplingParams(**kw), greedy(max_tokens=2)], use_tqdm=False)
    assert out[0].error == message and out[0].outputs[0].finish_reason == "error"
    assert out[1].error is None and len(out[1].outputs[0].token_ids) == 2


def test_rules_that_leave_no_token_fail_that_request_alone(llm):
    """The one allowed token is a bad word: that request ends with an error after the tokens it
    could take; the request beside it in the batch finishes as it would alone."""
    tok = llm.get_tokenizer()
    word = tok.decode([77])
    bad = greedy(allowed_token_ids=[77, 120], bad_words=[word], logit_bias={120: -5.0})
    outs = llm.generate(PROMPTS[:2], [bad, greedy()], use_tqdm=False)
    assert bad.bad_words_token_ids and [77] in bad.bad_words_token_ids
    assert outs[0].outputs[0].token_ids == [120] * 16  # 77 banned, 120 allowed: no failure yet
    dead = greedy(allowed_token_ids=[77], bad_words=[word])
    outs = llm.generate(PROMPTS[:2], [dead, greedy()], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "no token is left" in outs[0].error
    assert outs[0].outputs[0].token_ids == []
    assert outs[1].outputs[0].token_ids == tokens(llm, greedy(), PROMPTS[1:2])[0]
