"""Incremental detokenization on the real SmolLM2 tokenizer: one token at a time, and batched."""

from __future__ import annotations

import pytest

from ingot.loading.checkpoint import open_checkpoint
from ingot.loading.tokenizer import IncrementalDetokenizer, add_tokens

TEXTS = [
    "The café served naïve crème brûlée ☕ at 9:30.",
    "日本語のテキストと emoji 🎉🎉 mixed in.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
]


@pytest.fixture(scope="module")
def tok(smollm2_gguf):
    return open_checkpoint(str(smollm2_gguf)).tokenizer


def test_streamed_deltas_rebuild_the_text(tok):
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        det = IncrementalDetokenizer(tok, prompt_ids=tok.encode("Say:", add_special_tokens=False))
        deltas = [det.add([t]) for t in ids]
        assert "".join(deltas) == det.text == tok.decode(ids)  # whole characters only, none lost
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("streams", [True, False])
def test_batched_add_matches_one_by_one(tok, streams, monkeypatch):
    """Through DecodeStream, and through the window decode an older tokenizers falls back to."""
    import ingot.loading.tokenizer as tokenizer_mod

    monkeypatch.setattr(tokenizer_mod, "_STREAMS", streams)
    streams = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    eos = tok.eos_token_ids[0]
    for i in (1, 2):  # a special token: kept (stream 1) or skipped (stream 2) per request
        streams[i] = streams[i][:9] + [eos] + streams[i][9:]
    skips = [True, False, True]
    one = [IncrementalDetokenizer(tok, [], skip) for skip in skips]
    many = [IncrementalDetokenizer(tok, [], skip) for skip in skips]
    for step in range(max(len(s) for s in streams)):
        live = [i for i, s in enumerate(streams) if step < len(s)]
        expected = [one[i].add([streams[i][step]]) for i in live]
        got = add_tokens([many[i] for i in live], [[streams[i][step]] for i in live])
        assert got == expected
    assert [d.text for d in many] == [d.text for d in one]
    assert many[0].text == TEXTS[0]
    eos_text = tok.token_text(eos)
    assert eos_text in many[1].text and eos_text not in many[2].text
    assert many[2].text == TEXTS[2]


@pytest.mark.parametrize("cut", [None, -1, -2])
def test_deferred_then_final_matches_one_by_one(tok, cut):
    """Tokens deferred and decoded once at the end give the text that one-at-a-time
    decoding released, also when the output stops inside a multi-byte character."""
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        ids = ids if cut is None else ids[:cut]
        prompt = tok.encode("Say:", add_special_tokens=False)
        one = IncrementalDetokenizer(tok, prompt)
        for t in ids:
            one.add([t])
        lazy = IncrementalDetokenizer(tok, prompt)
        for t in ids:
            lazy.defer([t])
        assert lazy.text == ""
        (delta,) = add_tokens([lazy], [[]], final=True)
        assert delta == lazy.text == one.text
        assert "\ufffd" not in lazy.text


def test_final_releases_text_before_a_trailing_partial_character(tok):
    ids = tok.encode("ok 🎉", add_special_tokens=False)
    partial = next(i for i in range(1, len(ids) + 1) if tok.decode(ids[:i]).endswith("\ufffd"))
    lazy = IncrementalDetokenizer(tok, [])
    lazy.defer(ids[:partial])
    add_tokens([lazy], [[]], final=True)
    assert lazy.text == tok.decode(ids[:partial]).rstrip("\ufffd") and lazy.text.startswith("ok")


def test_stream_steps_equal_the_window_decode(tok):
    """The DecodeStream path releases exactly what decoding the two windows releases, one
    token or several at a time, after deferred tokens and after a rolled-back step."""
    import random

    rng = random.Random(3)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        prompt = tok.encode("Say:", add_special_tokens=False)
        fast, ref = IncrementalDetokenizer(tok, prompt), IncrementalDetokenizer(tok, prompt)
        i = 0
        while i < len(ids):
            k = rng.choice([1, 1, 1, 2, 3])
            chunk = ids[i : i + k]
            if rng.random() < 0.2:  # deferred: both only append
                fast.defer(chunk)
                ref.defer(chunk)
            else:
                if rng.random() < 0.2:  # a step that fails and is rolled back (the engine's isolation)
                    saved = (len(fast.ids), fast.prefix_offset, fast.read_offset, fast.text)
                    fast._step(chunk)
                    del fast.ids[saved[0] :]
                    fast.prefix_offset, fast.read_offset, fast.text = saved[1:]
                ref.ids.extend(chunk)
                prefix, full = tok.decode_batch(list(ref._windows()), ref.skip)
                assert fast._step(chunk) == ref._advance(prefix, full)
                assert (fast.prefix_offset, fast.read_offset, fast.text) == (ref.prefix_offset, ref.read_offset, ref.text)
            i += k
        assert add_tokens([fast], [[]], final=True) == add_tokens([ref], [[]], final=True)
        assert fast.text == ref.text == tok.decode(ids)
