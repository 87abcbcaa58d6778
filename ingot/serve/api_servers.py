"""``ingot serve --api-server-count N``: N API server processes over one engine process.

One API process writes every SSE chunk of every stream (tens of microseconds a
chunk, the socket write included); at tens of thousands of tokens/s it falls
behind the engine, merges several steps into each chunk, and tokens reach the
clients in bursts. N processes share that work:

- this process (the supervisor) binds the sockets, spawns the engine process with
  a pair of pipes per API server (``spawn_engine``) and, while the engine builds,
  the API servers, each handed its own listening socket on the one address and its
  own link to the engine (``bind_each``: the kernel spreads connections over the
  sockets); each opens its own tokenizer, waits for the engine, and runs the
  single-process server (``server.run_server``) over its link. A request's outputs come back on the
  pipes of the API server that sent it; the engine sends its stats to every link,
  so /metrics and /health read the same in each.
- /metrics: the latency histograms are prometheus_client's multiprocess files in
  a directory this process owns, summed by whichever API server is scraped.
- ``--max-queued-requests``: one in-flight count in shared memory, checked and
  changed under its lock. Request ids are random (uuid4) in every process.
- SIGTERM or SIGINT here goes to every API server (each aborts its requests, lets
  the responses go out and closes its link; the engine stops at the first closed
  link). An API server that exits on its own stops the others, and this process
  exits 1; one whose supervisor is gone shuts down (its pipe from here closes).
  An engine that dies leaves every API server up answering 503, as with one.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Optional

from ingot.engine.async_llm import AsyncLLM
from ingot.engine.engine_process import EngineLink, spawn_engine
from ingot.engine.stats import EngineInfo
from ingot.serve.server import GRACE_S, ServeOptions, bind, ready_line, run_server, server_settings
import uvicorn

from ingot.config import EngineConfig

log = logging.getLogger("ingot.serve")

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus_client when a process imports it


@dataclass
class _ApiServer:
    proc: Any  # multiprocessing.Process
    conn: Any  # our end of its pipe: it sends the engine's info once it accepts; closed, it tells it we are gone


class _Signals:
    """SIGINT and SIGTERM, recorded and made readable on a pipe, so ``wait`` wakes up for them."""

    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        self.received: Optional[int] = None
        self._old = {sig: signal.signal(sig, self._on) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _on(self, sig: int, frame: Any) -> None:
        self.received = sig
        os.write(self._w, b"!")

    def close(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        os.close(self.fd)
        os.close(self._w)


def serve_many(config: EngineConfig, options: ServeOptions) -> int:
    """Start the engine and ``options.api_server_count`` API servers; serve until a shutdown
    signal (0) or until an API server exits on its own (1)."""
    socks = bind_each(options.host, options.port, options.api_server_count)
    address = socks[0].getsockname()
    signals = _Signals()
    metrics_dir = tempfile.mkdtemp(prefix="ingot-metrics-")
    engine: Any = None
    servers: list[_ApiServer] = []
    try:
        engine, links = spawn_engine(config, options.api_server_count)
        os.environ[METRICS_DIR_ENV] = metrics_dir  # before the API servers import prometheus_client
        ctx = multiprocessing.get_context("spawn")
        in_flight = ctx.Value("q", 0) if options.max_queued_requests is not None else None
        for i, (sock, link) in enumerate(zip(socks, links)):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_api_server_main, name=f"ingot-api-{i}", daemon=True,
                               args=(config, options, sock, link, theirs, metrics_dir, in_flight))
            proc.start()
            # the API server holds them now (a socket of one that exits closes: no connection waits on it)
            for conn in (theirs, link.commands, link.outputs, sock):
                conn.close()
            servers.append(_ApiServer(proc, ours))
        info = _wait_ready(servers, signals)
        if info is None:
            return 0 if signals.received is not None else 1
        name = server_settings(config, options).model_name
        print(ready_line(address, name, info, f", {len(servers)} API servers"), file=sys.stderr, flush=True)
        return _supervise(servers, signals)
    finally:
        _stop(servers, engine)
        signals.close()
        for sock in socks:
            sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def bind_each(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` listening sockets on one address, one per API server: with SO_REUSEPORT the
    kernel spreads new connections evenly over them (where every process accepts on one socket,
    the first to wake takes a burst of connections whole). A plain bind first fails fast on a
    taken port, another server's several sockets included, and picks the port for port 0."""
    probe = bind(host, port)
    port = probe.getsockname()[1]
    probe.close()
    return [bind(host, port, reuse_port=True) for _ in range(count)]


def _wait_ready(servers: list[_ApiServer], signals: _Signals) -> Optional[EngineInfo]:
    """What the engine announced, once every API server accepts connections; None on a signal
    or an API server that exited first (logged; a failed engine fails each of them)."""
    waiting = {s.conn: s for s in servers}
    dead = {s.proc.sentinel: s for s in servers}
    info = None
    while waiting:
        ready = wait([*waiting, *dead, signals.fd])
        if signals.fd in ready:
            return None
        for obj in ready:
            if obj in dead:
                proc = dead[obj].proc
                log.error("%s exited while starting (exit code %s)", proc.name, proc.exitcode)
                return None
            info = waiting.pop(obj).conn.recv()
    return info


def _supervise(servers: list[_ApiServer], signals: _Signals) -> int:
    """Wait for a shutdown signal (0) or an API server that exits (1)."""
    dead = {s.proc.sentinel: s for s in servers}
    ready = wait([*dead, signals.fd])
    if signals.fd in ready:
        return 0
    proc = dead[next(obj for obj in ready if obj in dead)].proc
    log.error("%s exited (exit code %s); stopping the server", proc.name, proc.exitcode)
    return 1


def _stop(servers: list[_ApiServer], engine: Any) -> None:
    """SIGTERM to every API server (each shuts down as a single server does), then the engine,
    which stops once an API server closed its link; what does not stop in time is killed."""
    for s in servers:
        if s.proc.is_alive():
            s.proc.terminate()
    for s in servers:
        s.proc.join(GRACE_S + 25)
        if s.proc.is_alive():
            s.proc.kill()
            s.proc.join(5)
        s.conn.close()
    if engine is not None:
        engine.join(30)
        if engine.is_alive():
            engine.terminate()
            engine.join(5)


def _api_server_main(config: EngineConfig, options: ServeOptions, sock: socket.socket, link: EngineLink, parent: Any,
                     metrics_dir: str, in_flight: Any) -> None:
    """One API server: the single-process server over its own link to the engine."""
    logging.basicConfig(level=logging.WARNING if options.log_level == "warning" else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    llm = AsyncLLM.over_link(config, link)
    settings = server_settings(config, options, metrics_dir=metrics_dir, shared_in_flight=in_flight)

    def started(server: uvicorn.Server) -> None:
        loop = asyncio.get_running_loop()

        def orphaned() -> None:  # the supervisor is gone (its end of the pipe closed)
            loop.remove_reader(parent.fileno())
            server.handle_exit(signal.SIGTERM, None)

        loop.add_reader(parent.fileno(), orphaned)
        parent.send(llm.info)

    try:
        run_server(llm, settings, options, sock, started)
    finally:
        sock.close()
