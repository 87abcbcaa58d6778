"""The FastAPI application: OpenAI's completions and chat completions, models, tokenize,
detokenize, health, version and Prometheus metrics, on one AsyncLLM.

Handlers run on the event loop and only submit requests and await their
outputs; the engine steps in its own thread, so concurrent HTTP requests batch
together. A client that goes away (streaming or not) aborts its requests,
which frees their KV blocks before the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import ingot
from ingot.engine.async_llm import AsyncLLM
from ingot.engine.request import EngineRequest, RequestError
from ingot.outputs import RequestOutput
from ingot.sampling_params import SamplingError, SamplingParams
from ingot.serve import responses
from ingot.serve.errors import APIError, error_body, install_handlers
from ingot.serve.metrics import CONTENT_TYPE, ServerMetrics
from ingot.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _SamplingFields,
)


@dataclass
class ServerSettings:
    model_name: str  # what /v1/models lists and requests must name (or leave out)
    api_key: Optional[str] = None
    max_queued_requests: Optional[int] = None  # beyond the running batch; None = no limit


class _RequireApiKey:
    """Answers 401 to a /v1 request without ``Authorization: Bearer <key>``. Plain ASGI:
    Starlette's ``BaseHTTPMiddleware`` passes every streamed chunk through a memory
    stream and an event (a third of the server's CPU at 4,000 chunks/s)."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if given != self.expected:
                body = error_body(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                  code="invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _State:
    def __init__(self, llm: AsyncLLM, settings: ServerSettings) -> None:
        self.llm = llm
        self.settings = settings
        self.metrics = ServerMetrics(llm.stats, settings.model_name)
        self.in_flight = 0  # engine requests submitted and not finished
        self.created = int(time.time())
        self.capacity = llm.info.max_num_seqs + (settings.max_queued_requests or 0)


def build_app(llm: AsyncLLM, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="ingot", version=ingot.__version__, docs_url=None, redoc_url=None)
    state = _State(llm, settings)
    app.state.ingot = state
    install_handlers(app)

    if settings.api_key:
        app.add_middleware(_RequireApiKey, key=settings.api_key)

    @app.get("/health")
    async def health() -> Response:
        if not llm.alive:
            return JSONResponse(error_body(503, "the engine is not running"), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": ingot.__version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": state.created, "owned_by": "ingot",
            "root": settings.model_name, "max_model_len": llm.max_model_len,
        }]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        _check_model(body.model, settings)
        tok = llm.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", "prompt")
        if body.messages is not None:
            text = _render(llm, [m.as_dict() for m in body.messages], add_generation_prompt=body.add_generation_prompt)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        _check_model(body.model, settings)
        bad = [t for t in body.tokens if not 0 <= t < llm.info.vocab_size]
        if bad:
            raise APIError(400, f"token ids out of range: {bad[:5]}", "tokens")
        return {"prompt": llm.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        _check_common(body, settings)
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt must not be empty", "prompt")
        logprobs = body.logprobs
        params_for = _params_factory(body, body.max_tokens, logprobs, logprobs if (body.echo and logprobs is not None) else None)
        rid = f"cmpl-{uuid.uuid4().hex}"
        reqs = [_engine_request(llm, p, params_for, f"{rid}-{i}", body.stream, chat=False, salt=body.cache_salt)
                for i, p in enumerate(prompts)]
        flight = _Flight(state, reqs)
        run = _CompletionRun(rid, settings.model_name, body, reqs, llm.tokenizer)
        if body.stream:
            return _sse(flight, run.chunks(flight))
        return JSONResponse(run.response(await _collect(flight, raw)))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        _check_common(body, settings)
        text = _render(llm, [m.as_dict() for m in body.messages], add_generation_prompt=body.add_generation_prompt,
                       continue_final_message=body.continue_final_message, chat_template=body.chat_template)
        top = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        params_for = _params_factory(body, body.requested_max_tokens, top, None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        req = _engine_request(llm, text, params_for, rid, body.stream, chat=True, salt=body.cache_salt)
        flight = _Flight(state, [req])
        run = _ChatRun(rid, settings.model_name, body, req)
        if body.stream:
            return _sse(flight, run.chunks(flight))
        return JSONResponse(run.response(await _collect(flight, raw)))

    return app


# ---------------------------------------------------------------- request checks


def _check_model(model: Optional[str], settings: ServerSettings) -> None:
    if model is not None and model != settings.model_name:
        raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


def _check_common(body: _SamplingFields, settings: ServerSettings) -> None:
    _check_model(body.model, settings)
    field = body.unsupported()
    if field:
        raise APIError(400, f"{field} is not supported by ingot", field)


def _render(llm: AsyncLLM, messages: list[dict[str, Any]], **options: Any) -> str:
    try:
        return llm.render_chat(messages, **options)
    except RequestError as exc:
        raise APIError(400, str(exc), "messages") from None


def _params_factory(body: _SamplingFields, max_tokens: Optional[int], logprobs: Optional[int],
                    prompt_logprobs: Optional[int]) -> Callable[[int], SamplingParams]:
    """SamplingParams for a prompt of a given length: an explicit ``max_tokens`` must fit
    the context with the prompt (400 naming both lengths); none means up to the context."""

    def make(prompt_len: int, max_model_len: int) -> SamplingParams:
        room = max_model_len - prompt_len
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). "
                "Please reduce the length of the prompt or completion.",
                "max_tokens",
            )
        try:
            return body.sampling_params(max_tokens if max_tokens is not None else max(1, room), logprobs, prompt_logprobs)
        except SamplingError as exc:
            raise APIError(400, str(exc), str(exc).split(" ", 1)[0]) from None

    return make  # type: ignore[return-value]


def _engine_request(llm: AsyncLLM, prompt: Union[str, list[int]], params_for: Callable, rid: str, stream: bool,
                    chat: bool, salt: Optional[str] = None) -> EngineRequest:
    try:
        req = llm.process(prompt, None, rid, chat=chat, stream=stream)
    except RequestError as exc:
        message = str(exc)
        if "max_model_len" in message:
            message = (f"This model's maximum context length is {llm.max_model_len} tokens; the prompt has "
                       f"{message.split(' tokens', 1)[0].rsplit(' ', 1)[-1]} tokens, which leaves no room for a completion.")
        raise APIError(400, message, "messages" if chat else "prompt") from None
    req.params = params_for(len(req.prompt_token_ids), llm.max_model_len)
    req.cache_salt = salt
    return req


class _Flight:
    """One HTTP request's engine requests in flight: the server's count and metrics."""

    def __init__(self, state: _State, reqs: list[EngineRequest]) -> None:
        limit = state.settings.max_queued_requests
        if limit is not None and state.in_flight + len(reqs) > state.capacity:
            raise APIError(503, f"the server is at capacity ({state.in_flight} requests in flight, "
                                f"{limit} may queue); retry later", code="queue_full")
        if not state.llm.alive:
            raise APIError(503, "the engine is not running")
        self.state = state
        self.left = len(reqs)
        state.in_flight += len(reqs)
        self.group = state.llm.submit(reqs)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        async for out in self.group.outputs():
            if out.finished:
                self.left -= 1
                self.state.in_flight -= 1
                self.state.metrics.observe(out)
            yield out

    def close(self) -> None:
        """Abort what is left (the client went away, or an error) and forget it."""
        self.group.abort()
        self.state.in_flight -= self.left
        self.left = 0


async def _collect(flight: _Flight, raw: Request) -> dict[str, RequestOutput]:
    """The final outputs of a non-streaming request; aborted if the client disconnects."""

    async def gather() -> dict[str, RequestOutput]:
        return {out.request_id: out async for out in flight.outputs() if out.finished}

    task = asyncio.ensure_future(gather())
    watch = asyncio.ensure_future(_disconnected(raw))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:  # the client went away
            task.cancel()
            raise APIError(499, "client disconnected")
        finals = task.result()
    finally:
        watch.cancel()
        flight.close()
    errors = [o.error for o in finals.values() if o.error]
    if errors:
        raise APIError(500, f"the request failed in the engine: {errors[0]}")
    return finals


async def _disconnected(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(flight: _Flight, chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
        except APIError as exc:
            yield b"data: " + json.dumps(exc.body()).encode() + b"\n\n"
        finally:
            flight.close()  # a client that went away ends here too (the generator is closed)
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ---------------------------------------------------------------- completions


class _CompletionRun:
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
                choices.append({"index": i * self.body.n + c.index, "text": text + c.text, "logprobs": lp,
                                "finish_reason": responses.finish_reason(c), "stop_reason": c.stop_reason})
        return {**self._head(), "choices": choices, "usage": responses.usage(outs)}

    async def chunks(self, flight: "_Flight") -> AsyncIterator[dict[str, Any]]:
        builders: dict[int, Optional[responses.LegacyLogprobs]] = {}
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
                if text or lp is not None or reason is not None:
                    yield {**self._head(), "choices": [{"index": idx, "text": text, "logprobs": lp,
                                                        "finish_reason": reason, "stop_reason": c.stop_reason}]}
            if out.finished:
                finals[out.request_id] = out
        if self.body.include_usage:
            yield {**self._head(), "choices": [], "usage": responses.usage(list(finals.values()))}


# ---------------------------------------------------------------- chat


class _ChatRun:
    def __init__(self, rid: str, model: str, body: ChatCompletionRequest, req: EngineRequest) -> None:
        self.rid, self.model, self.body, self.req = rid, model, body, req
        self.created = int(time.time())
        self.top = body.top_logprobs or 0

    def _head(self) -> dict[str, Any]:
        return {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model}

    def response(self, finals: dict[str, RequestOutput]) -> dict[str, Any]:
        out = finals[self.req.request_id]
        choices = []
        for c in out.outputs:
            lp = responses.chat_logprobs(c.token_ids, c.logprobs or [], self.top) if self.body.logprobs else None
            choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                            "logprobs": lp, "finish_reason": responses.finish_reason(c), "stop_reason": c.stop_reason})
        return {**self._head(), "choices": choices, "usage": responses.usage([out])}

    async def chunks(self, flight: _Flight) -> AsyncIterator[dict[str, Any]]:
        head = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model}
        for i in range(self.body.n):
            yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]}
        final = None
        async for out in flight.outputs():
            if out.error:
                raise APIError(500, f"the request failed in the engine: {out.error}")
            for c in out.outputs:
                reason = responses.finish_reason(c)
                if not c.delta and reason is None and not (self.body.logprobs and c.delta_token_ids):
                    continue
                lp = responses.chat_logprobs(c.delta_token_ids, responses.new_logprobs(c), self.top) if self.body.logprobs else None
                delta = {"content": c.delta} if c.delta or reason is None else {}
                yield {**head, "choices": [{"index": c.index, "delta": delta, "logprobs": lp,
                                            "finish_reason": reason, "stop_reason": c.stop_reason}]}
            if out.finished:
                final = out
        if self.body.include_usage and final is not None:
            yield {**head, "choices": [], "usage": responses.usage([final])}
