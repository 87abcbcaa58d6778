"""Text completion responses and stream chunks (the legacy logprobs format, echo,
prompt logprobs, usage)."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Optional, Union

from ingot.engine.request import EngineRequest
from ingot.outputs import RequestOutput
from ingot.serve import responses
from ingot.serve.errors import APIError
from ingot.serve.protocol import CompletionRequest
from ingot.serve.sse import TextChunks


class CompletionRun:
    def __init__(self, rid: str, model: str, body: CompletionRequest, reqs: list[EngineRequest], tokenizer: Any) -> None:
        self.rid, self.model, self.body, self.reqs, self.tokenizer = rid, model, body, reqs, tokenizer
        self.created = int(time.time())
        self.index = {r.request_id: i for i, r in enumerate(reqs)}

    def _head(self) -> dict[str, Any]:
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model}

    def _echo(self, out: RequestOutput, builder: Optional[responses.LegacyLogprobs]) -> tuple[str, Optional[dict]]:
        """The echoed prompt text and, with logprobs, the prompt tokens' logprobs."""
        if not self.body.echo:
            return "", None
        text = out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)
        lp = None
        if builder is not None:
            lp = builder.block(out.prompt_token_ids, out.prompt_logprobs or [None] * len(out.prompt_token_ids))
        return text, lp

    def _builder(self) -> Optional[responses.LegacyLogprobs]:
        return None if self.body.logprobs is None else responses.LegacyLogprobs(self.body.logprobs, self.tokenizer)

    def response(self, finals: dict[str, RequestOutput]) -> dict[str, Any]:
        outs = [finals[r.request_id] for r in self.reqs]
        choices = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                builder = self._builder()
                text, lp = self._echo(out, builder)
                if builder is not None:
                    lp = responses.LegacyLogprobs.merge(lp, builder.block(c.token_ids, c.logprobs or []))
                choice = {"index": i * self.body.n + c.index, "text": text + c.text, "logprobs": lp,
                          "finish_reason": responses.finish_reason(c), "stop_reason": c.stop_reason}
                if self.body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = responses.prompt_logprobs(out.prompt_logprobs)
                choices.append(choice)
        return {**self._head(), "choices": choices, "usage": responses.usage(outs)}

    async def chunks(self, flight: responses.Outputs) -> AsyncIterator[Union[dict[str, Any], bytes]]:
        """The stream's chunks: dicts, or plain-text chunks already encoded (``sse.TextChunks``)."""
        builders: dict[int, Optional[responses.LegacyLogprobs]] = {}
        plain = None if self.body.continuous_usage else TextChunks(self._head(), "text")
        finals: dict[str, RequestOutput] = {}
        async for out in flight.outputs():
            if out.error:
                raise APIError(500, f"the request failed in the engine: {out.error}")
            for c in out.outputs:
                idx = self.index[out.request_id] * self.body.n + c.index
                text, lp = "", None
                if idx not in builders:  # this choice's first chunk
                    builders[idx] = self._builder()
                    text, lp = self._echo(out, builders[idx])
                text += c.delta
                builder = builders[idx]
                if builder is not None and c.delta_token_ids:
                    lp = responses.LegacyLogprobs.merge(lp, builder.block(c.delta_token_ids, responses.new_logprobs(c)))
                reason = responses.finish_reason(c)
                if lp is None and plain is not None and (text or reason is not None):
                    yield plain.text(idx, text, reason, c.stop_reason)
                elif text or lp is not None or reason is not None:
                    chunk = {**self._head(), "choices": [{"index": idx, "text": text, "logprobs": lp,
                                                          "finish_reason": reason, "stop_reason": c.stop_reason}]}
                    if self.body.continuous_usage:
                        chunk["usage"] = responses.usage([out])
                    yield chunk
            if out.finished:
                finals[out.request_id] = out
        if self.body.include_usage:
            yield {**self._head(), "choices": [], "usage": responses.usage(list(finals.values()))}
