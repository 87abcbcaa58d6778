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
from ingot.engine.request import Prompt
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
    def tokenizer(self):
        return self.engine.tokenizer

    def _bridge(self) -> _EventLoopBridge:
        loop = asyncio.get_running_loop()
        bridge = self._bridges.get(id(loop))
        if bridge is None or bridge.loop is not loop:
            bridge = self._bridges[id(loop)] = _EventLoopBridge(loop)
        return bridge

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
        request = self.engine.inputs.process(prompt, sampling_params, rid, stream=stream, chat=chat)
        sink = _AsyncSink(self._bridge())
        self.loop.submit(request, sink)
        finished = False
        try:
            while not finished:
                out = await sink.queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.loop.abort(rid)

    async def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def shutdown(self) -> None:
        self.loop.shutdown()

    def render_chat(self, conversation: Any, **options: Any) -> str:
        return self.engine.inputs.render_chat(conversation, **options)
