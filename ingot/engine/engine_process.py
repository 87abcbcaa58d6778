"""The engine in a child process: the server's HTTP work and the engine's steps never share a GIL.

The child builds the engine, runs an ``EngineLoop`` in it, reads commands
(add, abort, abort all, shut down) from one pipe and writes, once per engine
step, every output of that step, encoded compactly (``wire.py``), to another.
The client (``EngineProcessClient``, in the server's process) tokenizes and
validates requests itself and sends them, every command of one event-loop turn
as one message written without blocking (``_CommandWriter``); it reads the
outputs on its asyncio event loop (``add_reader``: no thread), decoding them
back into the engine's compact RequestOutputs (its caller adds them up).

Several clients (the API servers of ``ingot serve --api-server-count N``) each
get their own pair of pipes (``spawn_engine(config, N)``); the child's main
thread waits on all the command pipes, and each request's outputs go back on
the pipes of the client that sent it. A client whose requests have no outputs in
a step still gets the engine's stats, at most every ``STATS_EVERY_S`` and when
the engine goes idle. The child exits when any client closes its pipe or says
stop (so it never outlives the server, even one that was killed); a client fails
every request in flight if the child dies.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import struct
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Optional

from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.engine.engine_loop import EngineDeadError, EngineLoop
from ingot.engine.heap import freeze_heap
from ingot.engine.request import EngineRequest
from ingot.engine.stats import EngineInfo, EngineStats
from ingot.engine.wire import decode, encode, error_wire, merge
from ingot.outputs import RequestOutput

log = logging.getLogger(__name__)



class EngineStartError(RuntimeError):
    """The engine process could not build its engine (the message holds its traceback)."""


# ---------------------------------------------------------------- the child

STATS_EVERY_S = 0.02  # how stale a link without outputs of its own may let the engine's stats get


class _Link:
    """One client's pair of pipes, seen from the engine process: its commands arrive on
    ``commands``; ``put`` collects the encoded outputs of its requests, written as one message
    per loop turn by the shared flusher (``_Links``)."""

    def __init__(self, commands: Any, outputs: Any, flusher: "_Links") -> None:
        self.commands = commands
        self.conn = outputs
        self.flusher = flusher
        self._lock = threading.Lock()
        self._batch: list[tuple] = []
        self._sent: tuple = ()  # the stats last written
        self._sent_at = 0.0

    def put(self, output: RequestOutput) -> None:
        self.put_wire(encode(output))

    def put_wire(self, wire: tuple) -> None:
        with self._lock:
            self._batch.append(wire)

    def write(self, stats: tuple, now: float) -> None:
        """This turn's outputs with the engine's stats; with no outputs, the stats alone where
        they changed and are older than ``STATS_EVERY_S`` or the engine has gone idle (so every
        client's /metrics stays fresh while another client's requests run)."""
        with self._lock:
            batch, self._batch = self._batch, []
            if batch:
                msg: tuple = ("outputs", stats, batch)
            elif stats != self._sent and (now - self._sent_at >= STATS_EVERY_S or not (stats[0] or stats[1])):
                msg = ("stats", stats)
            else:
                return
            self.conn.send_bytes(pickle.dumps(msg, protocol=5))
            self._sent, self._sent_at = stats, now


class _Links:
    """Every client's link; the one flusher of their sinks, so each loop turn that delivered
    outputs reads the engine's stats once and writes once to each link."""

    def __init__(self, engine: Engine, pipes: list[tuple[Any, Any]]) -> None:
        self.engine = engine
        self.links = [_Link(commands, outputs, self) for commands, outputs in pipes]

    def flush(self) -> None:
        stats = tuple(self.engine.stats().__dict__.values())
        now = time.monotonic()
        for link in self.links:
            try:
                link.write(stats, now)
            except OSError:  # that client is gone (its commands pipe tells the main thread)
                pass


def child_main(config: EngineConfig, pipes: list[tuple[Any, Any]]) -> None:
    """The engine process: build, announce, serve the commands of every client (a pair of
    pipes each) until one of them says stop or goes away."""
    logging.basicConfig(level=logging.WARNING if not config.show_progress else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        engine = Engine(config)
    except BaseException:
        failed = pickle.dumps(("failed", traceback.format_exc()))
        for _, outputs in pipes:
            outputs.send_bytes(failed)
        return
    ready = pickle.dumps(("ready", engine.info()))
    for _, outputs in pipes:
        outputs.send_bytes(ready)
    freeze_heap()  # this process serves the engine it built until it exits
    loop = EngineLoop(engine)
    links = _Links(engine, pipes)
    try:
        _serve_commands(loop, links)
    finally:
        loop.shutdown()
        links.flush()
        for link in links.links:
            try:
                link.conn.send_bytes(pickle.dumps(("bye",)))
            except OSError:
                pass


def _serve_commands(loop: EngineLoop, links: _Links) -> None:
    """Carry out every client's commands as they come, until one says stop or goes away."""
    by_conn = {link.commands: link for link in links.links}
    while True:
        for conn in wait(list(by_conn)):
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # a client is gone: the server is going down
                return
            if not _apply(loop, by_conn[conn], msg[1] if msg[0] == "batch" else [msg]):
                return


def _apply(loop: EngineLoop, sink: _Link, commands: list[tuple]) -> bool:
    """Carry out one client's commands in order (the requests of consecutive adds are
    submitted together); False once told to shut down."""
    adds: list[EngineRequest] = []
    for msg in commands:
        kind = msg[0]
        if kind == "add":
            adds += msg[1]
            continue
        _submit(loop, sink, adds)
        adds = []
        if kind == "abort":
            loop.abort(msg[1])
        elif kind == "abort_all":
            loop.abort_all()
        elif kind == "shutdown":
            return False
    _submit(loop, sink, adds)
    return True


def _submit(loop: EngineLoop, sink: _Link, requests: list[EngineRequest]) -> None:
    if not requests:
        return
    try:
        loop.submit_all(requests, sink)
    except EngineDeadError as exc:
        for request in requests:
            sink.put_wire(error_wire(request.request_id, request.params.n, str(exc)))
        sink.flusher.flush()


# ---------------------------------------------------------------- the client


class _CommandWriter:
    """The client's end of the commands pipe. The commands of one event-loop turn go as one
    message (the engine process reads it at once: one wake-up of its command thread, which
    shares a GIL with the busy engine loop, instead of one per HTTP request), and the event
    loop never blocks on a full pipe: what does not fit waits here and is written when the
    pipe drains (``add_writer``). Message framing is ``Connection.send_bytes``'s."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.fd = conn.fileno()
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self._pending: list[tuple] = []
        self._buf = bytearray()
        self._waiting = False  # add_writer registered

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        os.set_blocking(self.fd, False)

    def send(self, command: tuple, threadsafe: bool = False) -> None:
        """Queue ``command``; written at the end of this event-loop turn (at once without a loop)."""
        if self.loop is None or self.loop.is_closed():
            self.send_now(command)
            return
        self._pending.append(command)
        if len(self._pending) == 1:
            (self.loop.call_soon_threadsafe if threadsafe else self.loop.call_soon)(self._flush)

    def send_now(self, command: tuple) -> None:
        """Write everything queued and ``command``, blocking until the pipe took it (shutdown)."""
        self._pending.append(command)
        self._frame()
        if self._waiting and self.loop is not None and not self.loop.is_closed():
            self.loop.remove_writer(self.fd)
        self._waiting = False
        os.set_blocking(self.fd, True)
        view, self._buf = memoryview(bytes(self._buf)), bytearray()
        while view:
            view = view[os.write(self.fd, view):]

    def _frame(self) -> None:
        if not self._pending:
            return
        commands, self._pending = self._pending, []
        data = ForkingPickler.dumps(("batch", commands))
        self._buf += struct.pack("!i", len(data))
        self._buf += data

    def _flush(self) -> None:
        self._frame()
        self._write()

    def _write(self) -> None:
        try:
            sent = os.write(self.fd, self._buf) if self._buf else 0
        except BlockingIOError:
            sent = 0
        except OSError:  # the engine process is gone; the outputs pipe reports it
            sent = len(self._buf)
        del self._buf[:sent]
        if self._buf and not self._waiting:
            self.loop.add_writer(self.fd, self._write)
            self._waiting = True
        elif not self._buf and self._waiting:
            self.loop.remove_writer(self.fd)
            self._waiting = False


PIPE_BYTES = 1 << 20  # Linux's default pipe-max-size for unprivileged processes


def widen_pipe(fd: int, size: int = PIPE_BYTES) -> int:
    """Grow a pipe from Linux's 64 KiB to ``size`` where the OS allows; returns the new
    size (0: unchanged). Outputs: a step of 256 streaming outputs pickles to tens of KiB, so at 64 KiB
    the engine's write blocks after a few steps whenever the server is busy writing HTTP
    chunks; with room for dozens of steps the engine keeps stepping and the server reads
    the backlog at once, merging each request's outputs (``_on_readable``). Commands: a burst of
    requests (hundreds of prompts of a thousand token ids) fits without waiting on the engine."""
    try:
        import fcntl

        return fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
    except (ImportError, AttributeError, OSError):  # not Linux, or above /proc/sys/fs/pipe-max-size
        return 0


@dataclass
class EngineLink:
    """A client's ends of its pair of pipes to the engine process; picklable into a spawned
    process (an API server of ``ingot serve --api-server-count``)."""

    commands: Any  # Connection: this side writes
    outputs: Any  # Connection: this side reads

    def ready(self, proc: Any = None) -> EngineInfo:
        """Wait for the engine to be built (EngineStartError if it failed); what it announced.
        ``proc``: the engine process, where this is its parent."""
        try:
            msg = pickle.loads(self.outputs.recv_bytes())
        except EOFError:
            code = "unknown" if proc is None else (proc.join(5), proc.exitcode)[1]
            raise EngineStartError(f"the engine process exited while starting (exit code {code})") from None
        if msg[0] == "failed":
            if proc is not None:
                proc.join(5)
            raise EngineStartError(f"the engine process failed to start:\n{msg[1]}")
        return msg[1]


def spawn_engine(config: EngineConfig, clients: int = 1) -> tuple[Any, list[EngineLink]]:
    """Spawn the engine process with a pair of pipes per client; returns at once (each client
    waits with ``link.ready()``, meanwhile free to start up itself)."""
    ctx = multiprocessing.get_context("spawn")  # CUDA must not be forked
    links, theirs = [], []
    for _ in range(clients):
        cmd_recv, cmd_send = ctx.Pipe(duplex=False)
        out_recv, out_send = ctx.Pipe(duplex=False)
        widen_pipe(out_send.fileno())
        widen_pipe(cmd_send.fileno())
        links.append(EngineLink(cmd_send, out_recv))
        theirs.append((cmd_recv, out_send))
    proc = ctx.Process(target=child_main, args=(config, theirs), name="ingot-engine", daemon=True)
    proc.start()
    for pair in theirs:
        for conn in pair:
            conn.close()
    return proc, links


class EngineProcessClient:
    """Talks to the engine process from one asyncio event loop, over one link: the engine it
    started itself (``start``), or one an API server was handed (``proc`` None)."""

    def __init__(self, link: EngineLink, info: EngineInfo, proc: Any = None) -> None:
        self.proc = proc
        self._cmd = link.commands
        self._out = link.outputs
        self._commands = _CommandWriter(self._cmd)
        self.info = info
        self._stats = EngineStats()
        self._sinks: dict[str, Callable[[RequestOutput], None]] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._dead: Optional[str] = None

    @classmethod
    def start(cls, config: EngineConfig) -> "EngineProcessClient":
        """Spawn the engine process and wait until it is ready."""
        proc, (link,) = spawn_engine(config)
        return cls(link, link.ready(proc), proc)

    # -------------------------------------------------------------- commands
    def attach(self) -> None:
        """Read the engine's messages on the running event loop from now on (else from the first
        request): a client among several gets stats, and learns of the engine's death, before
        it sends anything."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._commands.attach(loop)
            loop.add_reader(self._out.fileno(), self._on_readable)
            # uvloop (libuv) makes a polled fd non-blocking; a message is read whole once
            # poll() sees its start, so the pipe stays blocking (else recv_bytes can raise
            # BlockingIOError in the middle of a large step's outputs)
            os.set_blocking(self._out.fileno(), True)
        elif self._loop is not loop:
            raise RuntimeError("an EngineProcessClient serves one event loop")

    def submit(self, requests: list[EngineRequest], deliver: Callable[[RequestOutput], None]) -> None:
        """Send ``requests``; each output is handed to ``deliver`` on the event loop."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine process is not running: {self._dead}")
        self.attach()
        for r in requests:
            self._sinks[r.request_id] = deliver
        self._commands.send(("add", requests))

    def abort(self, request_id: str) -> None:
        if self._dead is None and request_id in self._sinks:
            self._commands.send(("abort", request_id))

    def abort_all(self) -> None:
        if self._dead is None:  # also from a signal handler
            try:
                self._commands.send(("abort_all",), threadsafe=True)
            except OSError:  # the engine is gone (its outputs pipe says so)
                pass

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def alive(self) -> bool:
        return self._dead is None and (self.proc is None or self.proc.is_alive())

    def shutdown(self, timeout: float = 30.0) -> None:
        """Ask the engine to stop (in-flight requests are aborted) and wait for the process."""
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(self._out.fileno())
            except (ValueError, OSError):
                pass
        if self._dead is None:
            try:
                self._commands.send_now(("shutdown",))
            except OSError:
                pass
        self._dead = self._dead or "shut down"
        if self.proc is not None:
            self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(5)
        self._cmd.close()
        self._out.close()

    # -------------------------------------------------------------- outputs
    def _on_readable(self) -> None:
        """Read every step that has arrived; each request's outputs among them are merged
        and delivered once (behind the engine, this process then does one decode, one
        queue put and one stream chunk per request for several steps)."""
        backlog: dict[str, list[tuple]] = {}
        try:
            while self._out.poll():
                msg = pickle.loads(self._out.recv_bytes())
                if msg[0] == "stats":
                    self._stats = EngineStats(*msg[1])
                elif msg[0] == "outputs":
                    self._stats = EngineStats(*msg[1])
                    for wire in msg[2]:
                        backlog.setdefault(wire[0], []).append(wire)
                elif msg[0] == "bye":
                    self._deliver(backlog)
                    self._die("the engine process stopped")
                    return
        except (EOFError, OSError):
            self._deliver(backlog)
            code = "" if self.proc is None else f" (exit code {self.proc.exitcode})"
            self._die(f"the engine process exited{code}")
            return
        self._deliver(backlog)

    def _deliver(self, backlog: dict[str, list[tuple]]) -> None:
        for wires in backlog.values():
            wire = merge(wires)
            rid, finished = wire[0], wire[1]
            deliver = self._sinks.pop(rid, None) if finished else self._sinks.get(rid)
            if deliver is not None:
                deliver(decode(wire))

    def _die(self, reason: str) -> None:
        if self._dead is None:
            log.error("%s; failing %d request(s) in flight", reason, len(self._sinks))
        self._dead = self._dead or reason
        if self._loop is not None:
            try:
                self._loop.remove_reader(self._out.fileno())
            except (ValueError, OSError):
                pass
        sinks, self._sinks = self._sinks, {}
        for rid, deliver in sinks.items():
            deliver(decode(error_wire(rid, 1, reason)))
