"""The asyncio event loop that serves ``AsyncLLM``: uvloop where it is installed.

uvicorn picks uvloop only when it creates the loop itself (``uvicorn.run``); the
server and the HTTP bench client run their own coroutines, so they ask here. The
default asyncio loop caps a streaming server at about 10,000 output tokens/s: one SSE
chunk (one socket write through asyncio's pure-Python transport) per token and request.
"""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on a uvloop loop when uvloop is installed, else on asyncio's own."""
    try:
        import uvloop
    except ImportError:  # Windows, or a minimal install
        return asyncio.run(main)
    return uvloop.run(main)
