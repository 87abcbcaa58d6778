"""The FastAPI application: OpenAI's completions and chat completions, models, tokenize,
detokenize, health, version and Prometheus metrics, on one AsyncLLM.

Handlers run on the event loop and only submit requests and await their
outputs; the engine steps in its own thread, so concurrent HTTP requests batch
together. A client that goes away (streaming or not) aborts its requests,
which frees their KV blocks before the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import ingot
from ingot.engine.async_llm import AsyncLLM
from ingot.engine.request import EngineRequest, RequestError
from ingot.engine.stats import EngineStats
from ingot.outputs import RequestOutput
from ingot.sampling_params import SamplingError, SamplingParams
from ingot.serve import responses, structured, tools
from ingot.serve.chat import ChatRun
from ingot.serve.completions import CompletionRun
from ingot.serve.errors import APIError, error_body, install_handlers
from ingot.serve.metrics import CONTENT_TYPE, ServerMetrics
from ingot.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _SamplingFields,
)
from ingot.serve.reasoning import ReasoningParser
from ingot.serve.sse import EventStream


@dataclass
class ServerSettings:
    model_name: str  # what /v1/models lists and requests must name (or leave out)
    api_key: Optional[str] = None
    max_queued_requests: Optional[int] = None  # beyond the running batch; None = no limit
    tools: tools.ToolSettings = field(default_factory=tools.ToolSettings)  # parsers for tools and reasoning
    # one of several API servers (api_servers.py): where their Prometheus files are summed, and the
    # in-flight count they share (a multiprocessing Value) when --max-queued-requests must hold across them
    metrics_dir: Optional[str] = None
    shared_in_flight: Any = None


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
        self.metrics = ServerMetrics(self.stats, settings.model_name, settings.metrics_dir)
        shared = settings.shared_in_flight
        self.in_flight = _Count() if shared is None else shared  # engine requests submitted and not finished
        self.created = int(time.time())
        self.capacity = llm.info.max_num_seqs + (settings.max_queued_requests or 0)
        self.special_tokens = {t.content for t in llm.tokenizer.tok.get_added_tokens_decoder().values() if t.special}

    def stats(self) -> EngineStats:
        """The engine's stats; once it is gone nothing runs, waits or holds KV blocks (its
        last report said otherwise), and its counters stay where they were."""
        stats = self.llm.stats()
        if self.llm.alive:
            return stats
        return dataclasses.replace(stats, num_running=0, num_waiting=0, kv_cache_usage=0.0)

    def model_card(self) -> dict[str, Any]:
        name = self.settings.model_name
        return {"id": name, "object": "model", "created": self.created, "owned_by": "ingot", "root": name,
                "parent": None, "max_model_len": self.llm.max_model_len}


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
        return {"object": "list", "data": [state.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != settings.model_name:
            raise APIError(404, f"The model `{model_id}` does not exist.", "model", "model_not_found")
        return state.model_card()

    @app.post("/v1/embeddings")
    async def embeddings() -> Response:
        raise APIError(400, "/v1/embeddings is not supported: ingot serves text generation (completions and chat "
                            "completions), not embedding models", "model")

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
            defs = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            text = _render(llm, [m.as_dict() for m in body.messages], add_generation_prompt=body.add_generation_prompt,
                           tools=defs, **(body.chat_template_kwargs or {}))
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
        echoed = logprobs if (body.echo and logprobs is not None) else None
        prompt_lp = max((v for v in (echoed, body.prompt_logprobs) if v is not None), default=None)
        so_param, so = structured.requested(body)
        params_for = _params_factory(body, body.max_tokens, logprobs, prompt_lp, so)
        rid = _response_id("cmpl", body)
        reqs = [_engine_request(llm, p, params_for, _engine_id(rid, body, f"-{i}"), body, chat=False, so_param=so_param)
                for i, p in enumerate(prompts)]
        flight = _Flight(state, reqs)
        run = CompletionRun(rid, settings.model_name, body, reqs, llm.tokenizer)
        if body.stream:
            return EventStream(flight, run.chunks(flight))
        return JSONResponse(run.response(await _collect(flight, raw)))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        _check_common(body, settings)
        problem = body.problem()
        if problem is not None:
            raise APIError(400, problem[1], problem[0])
        plan = tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls, settings.tools)
        defs = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        text = _render(llm, [m.as_dict() for m in body.messages], add_generation_prompt=body.add_generation_prompt,
                       continue_final_message=body.continue_final_message, chat_template=body.chat_template,
                       tools=defs, **body.template_kwargs())
        so_param, so = _chat_constraint(body, plan)
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        top = (body.top_logprobs or 0) if body.logprobs else None
        # a parser must see the tags of models that write them as special tokens (Mistral's
        # [TOOL_CALLS]); the end-of-sequence token's text is then taken off the reply
        special = plan is not None and plan.choice == "auto" and _special_markers(state, plan.parser(settings.tools))
        params_for = _params_factory(body, body.requested_max_tokens, top, body.prompt_logprobs, so,
                                     skip_special_tokens=body.skip_special_tokens and not special)
        rid = _response_id("chatcmpl", body)
        req = _engine_request(llm, text, params_for, _engine_id(rid, body), body, chat=True, so_param=so_param)
        make_stream = _stream_factory(body, plan, settings.tools, text)
        flight = _Flight(state, [req])
        eos = {t: llm.tokenizer.token_text(t) for t in llm.tokenizer.eos_token_ids} if special else {}
        run = ChatRun(rid, settings.model_name, body, req, make_stream, eos)
        if body.stream:
            return EventStream(flight, run.chunks(flight))
        return JSONResponse(run.response(await _collect(flight, raw)))

    return app


# ---------------------------------------------------------------- request checks


def _check_model(model: Optional[str], settings: ServerSettings) -> None:
    if model is not None and model != settings.model_name:
        raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


def _check_common(body: _SamplingFields, settings: ServerSettings) -> None:
    _check_model(body.model, settings)
    found = body.refused()
    if found is not None:
        raise APIError(400, found[1], found[0])
    if body.stream and body.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs cannot be streamed; send it without stream", "prompt_logprobs")


def _response_id(prefix: str, body: _SamplingFields) -> str:
    """``prefix-<hex>``, or vLLM's ``request_id`` when the client sent one (each engine
    request still gets its own id, so two clients sending one id cannot collide)."""
    return f"{prefix}-{body.request_id}" if body.request_id else f"{prefix}-{uuid.uuid4().hex}"


def _engine_id(rid: str, body: _SamplingFields, suffix: str = "") -> str:
    """The engine's id of a request: unique even when clients reuse a ``request_id``."""
    return f"{rid}{suffix}-{uuid.uuid4().hex[:12]}" if body.request_id else rid + suffix


def _render(llm: AsyncLLM, messages: list[dict[str, Any]], **options: Any) -> str:
    try:
        return llm.render_chat(messages, **options)
    except RequestError as exc:
        raise APIError(400, str(exc), "messages") from None


def _chat_constraint(body: ChatCompletionRequest, plan: Optional[tools.ToolPlan]) -> tuple[Optional[str], Any]:
    """(the field that asked, StructuredOutputsParams) of a chat request: its structured-output
    fields, or the constraint of a required / named tool choice (not both). With a reasoning
    parser the engine applies it to the answer after the reasoning."""
    so_param, so = structured.requested(body)
    if plan is not None and plan.schema is not None:
        if so is not None:
            raise APIError(400, f"{so_param} cannot be combined with tool_choice {plan.choice!r}: the tool calls "
                                "have their own constraint", so_param)
        so_param, so = "tools", structured.make_params({"json": plan.schema, "disable_any_whitespace": True}, "tools")
    return so_param, so


def _special_markers(state: _State, parser: Any) -> bool:
    """Is one of the parser's tags a special token of this vocabulary (dropped from text
    with ``skip_special_tokens``)?"""
    return any(m in state.special_tokens for m in getattr(parser, "MARKERS", ()))


def _stream_factory(body: ChatCompletionRequest, plan: Optional[tools.ToolPlan], settings: tools.ToolSettings,
                    prompt: str) -> Callable[[], Optional[tools.ChoiceStream]]:
    """A new ChoiceStream per choice, or None where the reply is plain text."""
    kind = settings.reasoning_parser
    has_tools = plan is not None and plan.choice != "none"
    if kind is None and not has_tools:
        return lambda: None

    def make() -> tools.ChoiceStream:
        return tools.ChoiceStream(ReasoningParser(kind, prompt) if kind else None,
                                  plan.parser(settings) if plan is not None else None,
                                  include_reasoning=body.include_reasoning, parallel=plan is None or plan.parallel,
                                  id_style=settings.tool_call_parser)

    return make


def _params_factory(body: _SamplingFields, max_tokens: Optional[int], logprobs: Optional[int],
                    prompt_logprobs: Optional[int], structured_outputs: Any = None,
                    **overrides: Any) -> Callable[[int, int], SamplingParams]:
    """SamplingParams for a prompt of a given length: an explicit ``max_tokens`` must fit
    the context with the prompt (400 naming both lengths); none means up to the context."""
    extra = dict(overrides)
    if structured_outputs is not None:
        extra["structured_outputs"] = structured_outputs

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
            return body.sampling_params(max_tokens if max_tokens is not None else max(1, room), logprobs,
                                        prompt_logprobs, **extra)
        except SamplingError as exc:
            raise APIError(400, str(exc), str(exc).split(" ", 1)[0]) from None

    return make


def _prompt_ids(llm: AsyncLLM, prompt: Union[str, list[int]], body: _SamplingFields, chat: bool) -> Union[str, list[int]]:
    """The prompt as token ids when the request asks for other special tokens than the
    default or for truncation (``truncate_prompt_tokens``: the last N, or with
    ``truncation_side: "right"`` the first N; -1: as many as leave room for one token)."""
    wants_special = body.add_special_tokens  # type: ignore[attr-defined]
    n = body.truncate_prompt_tokens
    # the engine encodes text with special tokens unless it is a chat template's (which has its own)
    if isinstance(prompt, str) and prompt and (wants_special == chat or n is not None):
        try:
            prompt = llm.tokenizer.encode(prompt, add_special_tokens=wants_special)
        except Exception as exc:  # the tokenizer's own error, for this prompt alone
            raise APIError(400, f"the tokenizer cannot encode this prompt: {exc}", "messages" if chat else "prompt") from None
    if n is not None and not isinstance(prompt, str):
        keep = llm.max_model_len - 1 if n == -1 else n
        prompt = list(prompt[:keep] if body.truncation_side == "right" else prompt[-keep:])
    return prompt


def _engine_request(llm: AsyncLLM, prompt: Union[str, list[int]], params_for: Callable, rid: str, body: _SamplingFields,
                    chat: bool, so_param: Optional[str] = None) -> EngineRequest:
    what = "messages" if chat else "prompt"
    try:
        req = llm.process(_prompt_ids(llm, prompt, body, chat), None, rid, chat=chat, stream=bool(body.stream))
    except RequestError as exc:
        message = str(exc)
        if "max_model_len" in message:
            message = (f"This model's maximum context length is {llm.max_model_len} tokens; the prompt has "
                       f"{message.split(' tokens', 1)[0].rsplit(' ', 1)[-1]} tokens, which leaves no room for a completion.")
        raise APIError(400, message, what) from None
    params = params_for(len(req.prompt_token_ids), llm.max_model_len)
    # token ids against the vocabulary, bad_words tokenized, a grammar checked (a schema
    # xgrammar cannot compile is this request's 400)
    try:
        llm.check_params(params)
    except RequestError as exc:
        if exc.param is not None:
            raise APIError(400, str(exc), exc.param) from None
        raise APIError(400, f"{so_param}: {exc}", so_param) from None
    req.params = params
    req.cache_salt = body.cache_salt
    return req


class _Count:
    """This process's in-flight count, read and changed as a ``multiprocessing.Value`` shared
    by several API servers is (under its lock; here none is needed)."""

    def __init__(self) -> None:
        self.value = 0

    def get_lock(self) -> contextlib.nullcontext:
        return contextlib.nullcontext()


class _Flight:
    """One HTTP request's engine requests in flight: the server's count and metrics."""

    def __init__(self, state: _State, reqs: list[EngineRequest]) -> None:
        limit = state.settings.max_queued_requests
        count = state.in_flight
        with count.get_lock():
            if limit is not None and count.value + len(reqs) > state.capacity:
                raise APIError(503, f"the server is at capacity ({count.value} requests in flight, "
                                    f"{limit} may queue); retry later", code="queue_full")
            if not state.llm.alive:
                raise APIError(503, "the engine is not running")
            count.value += len(reqs)
        self.state = state
        self.left = len(reqs)
        self.group = state.llm.submit(reqs)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        async for out in self.group.outputs():
            if out.finished:
                self._release(1)
                self.state.metrics.observe(out)
            yield out

    def close(self) -> None:
        """Abort what is left (the client went away, or an error) and forget it."""
        self.group.abort()
        self._release(self.left)

    def _release(self, n: int) -> None:
        if n:
            count = self.state.in_flight
            with count.get_lock():
                count.value -= n
            self.left -= n


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
