"""AsyncLLM: the engine loop for asyncio callers (the HTTP server).

``async for out in llm.generate(prompt, params, request_id)`` submits a request
and yields its outputs as the engine loop produces them; ``await
llm.abort(request_id)`` ends it from anywhere. The event loop never waits on a
GPU step: the engine runs in its own thread, and its outputs for all of one
event loop's requests arrive in one ``call_soon_threadsafe`` per engine step.
A generator that is closed before its request finished (the client went away,
the task was cancelled, the generator was garbage-collected) aborts the request.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any, AsyncIterator, Optional

from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.engine.engine_loop import EngineLoop
from ingot.engine.request import EngineRequest, Prompt
from ingot.engine.stats import EngineStats
from ingot.loading.tokenizer import Tokenizer
from ingot.outputs import RequestOutput
from ingot.sampling_params import SamplingParams


class _EventLoopBridge:
    """Carries outputs from the engine thread into one asyncio event loop, a batch per step."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, RequestOutput]] = []

    def push(self, q: asyncio.Queue, output: RequestOutput) -> None:  # engine thread
        with self._lock:
            self._items.append((q, output))

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
        for q, output in items:
            q.put_nowait(output)


class _AsyncSink:
    def __init__(self, bridge: _EventLoopBridge) -> None:
        self.flusher = bridge
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def put(self, output: RequestOutput) -> None:
        self.flusher.push(self.queue, output)


class RequestGroup:
    """Requests submitted together (the prompts of one HTTP request): their outputs share
    one queue. Iterate ``outputs()``; leaving it early, or ``abort()``, aborts the rest."""

    def __init__(self, loop: EngineLoop, sink: _AsyncSink, request_ids: list[str]) -> None:
        self._loop = loop
        self._sink = sink
        self.unfinished = set(request_ids)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        try:
            while self.unfinished:
                out = await self._sink.queue.get()
                if out.finished:
                    self.unfinished.discard(out.request_id)
                yield out
        finally:
            self.abort()

    def abort(self) -> None:
        for rid in self.unfinished:
            self._loop.abort(rid)
        self.unfinished = set()


class AsyncLLM:
    """An engine shared by coroutines; build it with ``AsyncLLM.from_config`` or around an Engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.loop = EngineLoop(engine)
        self._bridges: dict[int, _EventLoopBridge] = {}
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncLLM":
        return cls(Engine.from_config(config))

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def alive(self) -> bool:
        """False once the engine loop has shut down or died."""
        return self.loop.alive

    def _bridge(self) -> _EventLoopBridge:
        loop = asyncio.get_running_loop()
        bridge = self._bridges.get(id(loop))
        if bridge is None or bridge.loop is not loop:
            bridge = self._bridges[id(loop)] = _EventLoopBridge(loop)
        return bridge

    def process(self, prompt: Prompt, params: Optional[SamplingParams], request_id: str, *,
                chat: bool = False, stream: bool = True) -> EngineRequest:
        """Validate and tokenize (RequestError if invalid); nothing is queued yet."""
        return self.engine.inputs.process(prompt, params, request_id, stream=stream, chat=chat)

    def submit(self, requests: list[EngineRequest]) -> RequestGroup:
        """Queue processed requests; their outputs come through the returned group."""
        sink = _AsyncSink(self._bridge())
        for request in requests:
            self.loop.submit(request, sink)
        return RequestGroup(self.loop, sink, [r.request_id for r in requests])

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
        self.loop.abort(request_id)

    def abort_all(self) -> None:
        """Abort every request in flight (server shutdown)."""
        self.loop.abort_all()

    def shutdown(self) -> None:
        self.loop.shutdown()

    def render_chat(self, conversation: Any, **options: Any) -> str:
        """The chat template's text (RequestError if the conversation cannot be rendered)."""
        return self.engine.inputs.render_chat(conversation, **options)
