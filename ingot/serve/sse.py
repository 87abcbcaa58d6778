"""A generation's server-sent events: ``data: {json}`` per chunk, ``data: [DONE]`` last.

A plain ASGI response rather than Starlette's StreamingResponse, which opens an
anyio task group per response (a third of the server's time while hundreds of
requests arrive at once). One watcher task per stream waits for the client to
go away and cancels the stream then, wherever it waits (the engine's outputs,
a full socket), which aborts the request; ``[DONE]`` goes out with the
response's last write.
"""

from __future__ import annotations

import asyncio
import json
from json.encoder import encode_basestring
from typing import Any, AsyncIterator, Callable, Optional, Protocol, Union

from starlette.responses import Response

from ingot.serve.errors import APIError

DONE = b"data: [DONE]\n\n"


class Closable(Protocol):
    def close(self) -> None: ...


def encode(chunk: dict[str, Any]) -> bytes:
    """One event: the chunk as compact JSON, non-ASCII text as UTF-8."""
    return b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _value(v: Union[None, str, int]) -> str:
    if v is None:
        return "null"
    if isinstance(v, str):
        return encode_basestring(v)
    return json.dumps(v)


class TextChunks:
    """The events of one stream's plain-text chunks (``{head, "choices": [{"index", <text field>,
    "logprobs": null, "finish_reason", "stop_reason"}]}``), written from a prefix encoded once:
    byte for byte what ``encode`` makes of the same dict, at a tenth of its cost (json.dumps
    sets up an encoder per call, and a server writes one chunk per request per step)."""

    def __init__(self, head: dict[str, Any], field: str) -> None:
        self.prefix = "data: " + json.dumps(head, ensure_ascii=False, separators=(",", ":"))[:-1] + ',"choices":[{"index":'
        self.field = f',"{field}":'

    def text(self, index: int, text: str, finish_reason: Optional[str], stop_reason: Union[None, str, int]) -> bytes:
        """``text`` as a string field (completions' ``text``)."""
        return (f"{self.prefix}{index}{self.field}{encode_basestring(text)},\"logprobs\":null,\"finish_reason\":"
                f"{_value(finish_reason)},\"stop_reason\":{_value(stop_reason)}}}]}}\n\n").encode()

    def delta(self, index: int, content: Optional[str], finish_reason: Optional[str],
              stop_reason: Union[None, str, int]) -> bytes:
        """``{"content": content}`` as an object field (chat's ``delta``; ``{}`` for None)."""
        body = "{}" if content is None else '{"content":' + encode_basestring(content) + "}"
        return (f"{self.prefix}{index}{self.field}{body},\"logprobs\":null,\"finish_reason\":"
                f"{_value(finish_reason)},\"stop_reason\":{_value(stop_reason)}}}]}}\n\n").encode()


class EventStream(Response):
    """The events of ``chunks`` (dicts, or events already encoded); ``flight.close()`` once they
    end, fail or the client leaves."""

    media_type = "text/event-stream"

    def __init__(self, flight: Closable, chunks: AsyncIterator[Union[dict[str, Any], bytes]]) -> None:
        self.flight = flight
        self.chunks = chunks
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache"})

    async def _events(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.chunks:
                yield chunk if isinstance(chunk, bytes) else encode(chunk)
        except APIError as exc:
            yield b"data: " + json.dumps(exc.body()).encode() + b"\n\n"
        finally:
            self.flight.close()  # a client that went away ends here too (the stream is cancelled)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        task = asyncio.current_task()
        state = {"streaming": True, "gone": False}

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if state["streaming"]:  # (after the last write, uvicorn reports a disconnect too)
                state["gone"] = True
                task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for data in self._events():
                await send({"type": "http.response.body", "body": data, "more_body": True})
            state["streaming"] = False
            await send({"type": "http.response.body", "body": DONE, "more_body": False})
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            uncancel = getattr(task, "uncancel", None)  # Python 3.11+: the cancel was ours, handled
            if uncancel is not None:
                uncancel()
        finally:
            state["streaming"] = False
            watcher.cancel()
