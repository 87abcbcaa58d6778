"""The pre-encoded plain-text chunks are byte for byte what encoding the chunk's dict gives."""

from __future__ import annotations

import pytest

from ingot.serve.sse import TextChunks, encode

HEAD = {"id": "cmpl-\"x\"", "object": "text_completion", "created": 1700000000, "model": "mödel/ü"}
TEXTS = ["", " hello", "héllo wörld ✓", 'quote " and \\ backslash', "tab\tnew\nline\x00\x1f", "emoji 🦙"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("reason,stop", [(None, None), ("stop", "###"), ("stop", 2), ("length", None), ("abort", None)])
def test_completion_chunks_equal_the_dict_encoding(text, reason, stop):
    chunks = TextChunks(HEAD, "text")
    want = encode({**HEAD, "choices": [{"index": 3, "text": text, "logprobs": None, "finish_reason": reason,
                                        "stop_reason": stop}]})
    assert chunks.text(3, text, reason, stop) == want


@pytest.mark.parametrize("content", [None, *TEXTS])
@pytest.mark.parametrize("reason,stop", [(None, None), ("stop", "</s>"), ("stop", 151645)])
def test_chat_chunks_equal_the_dict_encoding(content, reason, stop):
    head = {**HEAD, "object": "chat.completion.chunk"}
    chunks = TextChunks(head, "delta")
    delta = {} if content is None else {"content": content}
    want = encode({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason,
                                        "stop_reason": stop}]})
    assert chunks.delta(0, content, reason, stop) == want
