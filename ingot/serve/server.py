"""Run the server: build the engine, bind, log one line when ready, shut down cleanly.

On SIGINT or SIGTERM the server stops accepting connections, aborts every
request in flight (streams end with their last chunk and ``[DONE]``), waits
briefly for the responses to go out, stops the engine and returns 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import uvicorn

from ingot.config import EngineConfig
from ingot.engine import event_loop
from ingot.engine.async_llm import AsyncLLM
from ingot.engine.heap import freeze_heap
from ingot.engine.stats import EngineInfo
from ingot.serve.app import ServerSettings, build_app
from ingot.serve.tools import ToolSettings

log = logging.getLogger("ingot.serve")

API_KEY_ENV = "INGOT_API_KEY"
GRACE_S = 5  # how long responses of aborted requests may take to go out at shutdown


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the ready line says which)
    api_key: Optional[str] = None  # None: INGOT_API_KEY, if set
    served_model_name: Optional[str] = None
    max_queued_requests: Optional[int] = None
    # the engine in a child process (no GIL shared with the HTTP work) rather than a thread
    engine_process: bool = True
    log_level: str = "warning"  # uvicorn's own access/error logging
    tool_call_parser: Optional[str] = None  # hermes | llama3_json | mistral: finds tool calls for "auto"
    enable_auto_tool_choice: bool = False
    api_server_count: int = 1  # API server processes sharing the socket and one engine process (api_servers.py)


def model_name(config: EngineConfig) -> str:
    """What clients call the model: the path's last part, or the default model's name
    (``random-`` in front with random weights)."""
    if config.model is None:
        name = "SmolLM2-135M-Instruct"
    else:
        name = os.path.basename(config.model.rstrip("/")) or config.model
    return f"random-{name}" if config.load_format == "dummy" else name


class _Server(uvicorn.Server):
    """uvicorn, plus: abort the engine's requests as soon as a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, llm: AsyncLLM) -> None:
        super().__init__(config)
        self.llm = llm

    def handle_exit(self, sig: int, frame) -> None:  # type: ignore[override]
        self.llm.abort_all()
        super().handle_exit(sig, frame)
        # a clean shutdown exits 0; uvicorn would re-raise the signal once it has stopped
        self._captured_signals.clear()


def bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening socket (``reuse_port``: one of several on this address, SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(config: EngineConfig, options: ServeOptions) -> int:
    """Build the engine, serve until a shutdown signal; returns the exit code."""
    sock = bind(options.host, options.port)  # fail fast on a taken port, before loading the model
    llm = build_llm(config, options)
    settings = server_settings(config, options)
    ready = ready_line(sock.getsockname(), settings.model_name, llm.info)
    try:
        run_server(llm, settings, options, sock, lambda _: print(ready, file=sys.stderr, flush=True))
    finally:
        sock.close()
    return 0


def ready_line(address: tuple, name: str, info: EngineInfo, more: str = "") -> str:
    """The one line printed once the server accepts connections on ``address`` (``more``: said last)."""
    host, port = address[:2]
    return (f"ingot serve: ready on http://{host}:{port} (model {name}, KV cache {info.kv_capacity_tokens} tokens in "
            f"{info.num_kv_blocks} blocks, max_model_len {info.max_model_len}, max_num_seqs {info.max_num_seqs}{more})")


def server_settings(config: EngineConfig, options: ServeOptions, **extra: Any) -> ServerSettings:
    api_key = options.api_key if options.api_key is not None else os.environ.get(API_KEY_ENV) or None
    name = options.served_model_name or model_name(config)
    tools = ToolSettings(options.tool_call_parser, options.enable_auto_tool_choice, config.reasoning_parser)
    return ServerSettings(name, api_key, options.max_queued_requests, tools, **extra)


def run_server(llm: AsyncLLM, settings: ServerSettings, options: ServeOptions, sock: socket.socket,
               on_started: Callable[["_Server"], None]) -> None:
    """Serve the app on ``sock`` until a shutdown signal (``on_started`` once it accepts), then
    stop ``llm``."""
    uv_config = uvicorn.Config(build_app(llm, settings), log_level=options.log_level,
                               timeout_graceful_shutdown=GRACE_S, timeout_keep_alive=30, access_log=False)
    server = _Server(uv_config, llm)
    freeze_heap()  # what this process serves with lives until it exits
    try:
        event_loop.run(_serve(server, sock, on_started))
    finally:
        llm.shutdown()


def build_llm(config: EngineConfig, options: ServeOptions) -> AsyncLLM:
    """The engine the server runs, in a child process or in a thread of this one."""
    if options.engine_process:
        return AsyncLLM.in_process(config)
    return AsyncLLM.from_config(config)


async def _serve(server: _Server, sock: socket.socket, on_started: Callable[[_Server], None]) -> None:
    async def announce() -> None:
        while not server.started and not server.should_exit:
            await asyncio.sleep(0.01)
        if server.started:
            on_started(server)

    server.llm.attach()
    task = asyncio.ensure_future(announce())
    try:
        await server.serve(sockets=[sock])
    finally:
        task.cancel()
