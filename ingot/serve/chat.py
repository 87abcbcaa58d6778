"""Chat completion responses and stream chunks, with reasoning and tool calls split out.

A plain chat (no reasoning parser, no tools in play) sends each step's new text as
``delta.content``. Otherwise each choice's text goes through a ``ChoiceStream``:
the reply is rebuilt as ``reasoning_content``, ``content`` and ``tool_calls``, and a
stream sends what each step adds to them. A reply that called tools and stopped by
itself ends with ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Callable, Optional, Union

from ingot.engine.request import EngineRequest
from ingot.outputs import CompletionOutput, RequestOutput
from ingot.serve import responses
from ingot.serve.errors import APIError
from ingot.serve.protocol import ChatCompletionRequest
from ingot.serve.sse import TextChunks
from ingot.serve.tools import ChoiceStream


def _finish(c: CompletionOutput, called: bool) -> Optional[str]:
    reason = responses.finish_reason(c)
    return "tool_calls" if called and reason == "stop" else reason


class ChatRun:
    def __init__(self, rid: str, model: str, body: ChatCompletionRequest, req: EngineRequest,
                 make_stream: Callable[[], Optional[ChoiceStream]], eos_texts: Optional[dict[int, str]] = None) -> None:
        self.rid, self.model, self.body, self.req = rid, model, body, req
        self.make_stream = make_stream
        self.eos_texts = eos_texts or {}  # with special tokens in the text: an end token's text to take off
        self.created = int(time.time())
        self.top = body.top_logprobs or 0

    def _text(self, c: CompletionOutput) -> str:
        """The reply's text, less the end-of-sequence token that ended it, if its text is there."""
        eos = self.eos_texts.get(c.stop_reason) if isinstance(c.stop_reason, int) else None
        return c.text[: -len(eos)] if eos and c.text.endswith(eos) else c.text

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model}

    def response(self, finals: dict[str, RequestOutput]) -> dict[str, Any]:
        out = finals[self.req.request_id]
        choices = []
        for c in out.outputs:
            lp = responses.chat_logprobs(c.token_ids, c.logprobs or [], self.top) if self.body.logprobs else None
            stream = self.make_stream()
            message = {"role": "assistant", "content": c.text} if stream is None else stream.message(self._text(c))
            choices.append({"index": c.index, "message": message, "logprobs": lp,
                            "finish_reason": _finish(c, "tool_calls" in message), "stop_reason": c.stop_reason})
        body = {**self._head("chat.completion"), "choices": choices, "usage": responses.usage([out])}
        if self.body.prompt_logprobs is not None:
            body["prompt_logprobs"] = responses.prompt_logprobs(out.prompt_logprobs)
        return body

    async def chunks(self, flight: responses.Outputs) -> AsyncIterator[Union[dict[str, Any], bytes]]:
        """The stream's chunks: dicts, or plain-text chunks already encoded (``sse.TextChunks``)."""
        head = self._head("chat.completion.chunk")
        continuous = self.body.continuous_usage
        plain = None if continuous or self.body.logprobs else TextChunks(head, "delta")
        streams = [self.make_stream() for _ in range(self.body.n)]
        for i in range(self.body.n):
            first = {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]}
            if continuous:
                first["usage"] = responses.usage_of(len(self.req.prompt_token_ids), 0, 0)
            yield first
        final = None
        async for out in flight.outputs():
            if out.error:
                raise APIError(500, f"the request failed in the engine: {out.error}")
            for c in out.outputs:
                reason = responses.finish_reason(c)
                if not c.delta and reason is None and not (self.body.logprobs and c.delta_token_ids):
                    continue
                stream = streams[c.index]
                lp = responses.chat_logprobs(c.delta_token_ids, responses.new_logprobs(c), self.top) if self.body.logprobs else None
                if stream is None and plain is not None:
                    yield plain.delta(c.index, c.delta if c.delta or reason is None else None, reason, c.stop_reason)
                    continue
                if stream is None:
                    delta: dict[str, Any] = {"content": c.delta} if c.delta or reason is None else {}
                else:
                    delta = stream.delta(self._text(c), reason is not None)
                    reason = _finish(c, stream.called)
                    if not delta and reason is None and lp is None:
                        continue
                chunk = {**head, "choices": [{"index": c.index, "delta": delta, "logprobs": lp,
                                              "finish_reason": reason, "stop_reason": c.stop_reason}]}
                if continuous:
                    chunk["usage"] = responses.usage([out])
                yield chunk
            if out.finished:
                final = out
        if self.body.include_usage and final is not None:
            yield {**head, "choices": [], "usage": responses.usage([final])}
