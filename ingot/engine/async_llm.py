"""AsyncLLM: the engine for asyncio callers (the HTTP server).

``async for out in llm.generate(prompt, params, request_id)`` submits a request
and yields its outputs as the engine produces them; ``await llm.abort(request_id)``
ends it from anywhere. The event loop never waits on a GPU step. The engine
runs either in a thread of this process (``AsyncLLM(engine)``: an ``EngineLoop``,
whose outputs for all of one event loop's requests arrive in one
``call_soon_threadsafe`` per step) or in a child process
(``AsyncLLM.in_process(...)``, ``engine_process.py``: no GIL shared with the
caller's work). A generator or request group left before its requests finished
(the client went away, the task was cancelled, the generator was collected)
aborts them.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any, AsyncIterator, Callable, Optional, Protocol

from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.engine.engine_loop import EngineLoop
from ingot.engine.engine_process import EngineLink, EngineProcessClient
from ingot.engine.outputs import Accumulator
from ingot.engine.request import EngineRequest, InputProcessor, Prompt
from ingot.engine.stats import EngineInfo, EngineStats
from ingot.loading.checkpoint import open_checkpoint
from ingot.loading.tokenizer import Tokenizer
from ingot.outputs import RequestOutput
from ingot.sampling_params import SamplingParams

Deliver = Callable[[RequestOutput], None]


class Backend(Protocol):
    """Where the engine runs: submit with a delivery callback (called on the event loop)."""

    info: EngineInfo

    def submit(self, requests: list[EngineRequest], deliver: Deliver) -> None: ...
    def attach(self) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def abort_all(self) -> None: ...
    def stats(self) -> EngineStats: ...
    @property
    def alive(self) -> bool: ...
    def shutdown(self) -> None: ...


class _EventLoopBridge:
    """Carries outputs from the engine thread into one asyncio event loop, a batch per step."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Deliver, RequestOutput]] = []

    def push(self, deliver: Deliver, output: RequestOutput) -> None:  # engine thread
        with self._lock:
            self._items.append((deliver, output))

    def flush(self) -> None:  # engine thread, once per step
        with self._lock:
            if not self._items:
                return
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the event loop is closed: nobody is left to read
            with self._lock:
                self._items.clear()

    def _drain(self) -> None:  # event loop thread
        with self._lock:
            items, self._items = self._items, []
        for deliver, output in items:
            deliver(output)


class _BridgeSink:
    def __init__(self, bridge: _EventLoopBridge, deliver: Deliver) -> None:
        self.flusher = bridge
        self.deliver = deliver

    def put(self, output: RequestOutput) -> None:
        self.flusher.push(self.deliver, output)


class ThreadBackend:
    """The engine in a thread of this process (``EngineLoop``)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.loop = EngineLoop(engine)
        self.info = engine.info()
        self._bridges: dict[int, _EventLoopBridge] = {}

    def submit(self, requests: list[EngineRequest], deliver: Deliver) -> None:
        loop = asyncio.get_running_loop()
        bridge = self._bridges.get(id(loop))
        if bridge is None or bridge.loop is not loop:
            bridge = self._bridges[id(loop)] = _EventLoopBridge(loop)
        self.loop.submit_all(requests, _BridgeSink(bridge, deliver))

    def attach(self) -> None:
        """Nothing to do: the engine thread reaches each event loop when it submits."""

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def abort_all(self) -> None:
        self.loop.abort_all()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def alive(self) -> bool:
        return self.loop.alive

    def shutdown(self) -> None:
        self.loop.shutdown()


class _Outbox:
    """Where the engine's outputs for one reader pile up: ``put_nowait`` from the event loop,
    ``take`` everything at once. An asyncio.Queue without what a single reader that always
    empties it never uses (a bound, putters, task counting): a server puts and takes once
    per request per step."""

    def __init__(self) -> None:
        self._items: list[RequestOutput] = []
        self._waiter: Optional[asyncio.Future] = None

    def put_nowait(self, item: RequestOutput) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def take(self) -> list[RequestOutput]:
        """Every output put since the last take; waits for one if there is none."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


class RequestGroup:
    """Requests submitted together (the prompts of one HTTP request): their outputs share
    one outbox. Iterate ``outputs()``; leaving it early, or ``abort()``, aborts the rest."""

    def __init__(self, backend: Backend, request_ids: list[str]) -> None:
        self._backend = backend
        self.queue = _Outbox()  # the engine's compact outputs
        self._totals = Accumulator()
        self.unfinished = set(request_ids)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Each request's cumulative output, as it advances; a reader slower than the
        engine gets one output per request for several steps (its ``delta`` spans them)."""
        try:
            while self.unfinished:
                piled = await self.queue.take()  # behind the engine: what piled up, at once
                for out in self._totals.add_all(piled):
                    if out.finished:
                        self.unfinished.discard(out.request_id)
                    yield out
        finally:
            self.abort()

    def abort(self) -> None:
        for rid in self.unfinished:
            self._backend.abort(rid)
        self.unfinished = set()


def _tokenizer(config: EngineConfig) -> Tokenizer:
    return open_checkpoint(config.model, config.tokenizer, config.load_format).tokenizer


class AsyncLLM:
    """An engine shared by coroutines. ``AsyncLLM(engine)`` runs it in a thread;
    ``AsyncLLM.in_process(config)`` in a child process."""

    def __init__(self, engine: Engine) -> None:
        self._init(ThreadBackend(engine), engine.tokenizer)

    def _init(self, backend: Backend, tokenizer: Tokenizer) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.info = backend.info
        self.inputs = InputProcessor(tokenizer, self.info.vocab_size, self.info.max_model_len)
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncLLM":
        return cls(Engine(config))

    @classmethod
    def in_process(cls, config: EngineConfig) -> "AsyncLLM":
        """``Engine(config)``, run in a child process; requests are tokenized here, with the
        same tokenizer (opened without the weights)."""
        tokenizer = _tokenizer(config)
        return cls._over(EngineProcessClient.start(config), tokenizer)

    @classmethod
    def over_link(cls, config: EngineConfig, link: EngineLink) -> "AsyncLLM":
        """A client of an engine process another process started (an API server of several);
        the tokenizer is opened while the engine builds."""
        tokenizer = _tokenizer(config)
        return cls._over(EngineProcessClient(link, link.ready()), tokenizer)

    @classmethod
    def _over(cls, client: EngineProcessClient, tokenizer: Tokenizer) -> "AsyncLLM":
        llm = cls.__new__(cls)
        llm._init(client, tokenizer)
        return llm

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def stats(self) -> EngineStats:
        return self.backend.stats()

    @property
    def alive(self) -> bool:
        """False once the engine has shut down or died."""
        return self.backend.alive

    def process(self, prompt: Prompt, params: Optional[SamplingParams], request_id: str, *,
                chat: bool = False, stream: bool = True) -> EngineRequest:
        """Validate and tokenize (RequestError if invalid); nothing is queued yet."""
        return self.inputs.process(prompt, params, request_id, stream=stream, chat=chat)

    def check_params(self, params: SamplingParams) -> None:
        """Check ``params`` against the model (``InputProcessor.check_params``); RequestError if they do not fit."""
        self.inputs.check_params(params)

    def submit(self, requests: list[EngineRequest]) -> RequestGroup:
        """Queue processed requests; their outputs come through the returned group."""
        group = RequestGroup(self.backend, [r.request_id for r in requests])
        self.backend.submit(requests, group.queue.put_nowait)
        return group

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        *,
        chat: bool = False,
        stream: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come (with ``stream=False``, only the final one).

        Raises RequestError (before anything is queued) for an invalid request.
        ``chat``: ``prompt`` is text rendered by the chat template.
        """
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        group = self.submit([self.process(prompt, sampling_params, rid, chat=chat, stream=stream)])
        async for out in group.outputs():
            yield out

    async def abort(self, request_id: str) -> None:
        self.backend.abort(request_id)

    def attach(self) -> None:
        """Take the engine's news (stats, its death) on the running event loop from now on,
        before any request (``ingot serve`` at start)."""
        self.backend.attach()

    def abort_all(self) -> None:
        """Abort every request in flight (server shutdown)."""
        self.backend.abort_all()

    def shutdown(self) -> None:
        self.backend.shutdown()

    def render_chat(self, conversation: Any, **options: Any) -> str:
        """The chat template's text (RequestError if the conversation cannot be rendered)."""
        return self.inputs.render_chat(conversation, **options)
