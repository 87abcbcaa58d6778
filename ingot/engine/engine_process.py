"""The engine in a child process: the server's HTTP work and the engine's steps never share a GIL.

The child builds the engine, runs an ``EngineLoop`` in it, reads commands
(add, abort, abort all, shut down) from one pipe and writes, once per engine
step, every output of that step, encoded compactly (``wire.py``), to another.
The client (``EngineProcessClient``, in the server's process) tokenizes and
validates requests itself and sends them, every command of one event-loop turn
as one message written without blocking (``_CommandWriter``); it reads the
outputs on its asyncio event loop (``add_reader``: no thread), decoding them
back into the engine's compact RequestOutputs (its caller adds them up). The child exits when the client closes its pipe (so it never
outlives the server, even one that was killed); the client fails every request
in flight if the child dies.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import struct
import threading
import traceback
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


class _PipeSink:
    """Collects a step's encoded outputs; ``flush`` (once per loop turn) writes them as one message."""

    def __init__(self, conn: Any, engine: Engine) -> None:
        self.conn = conn
        self.engine = engine
        self.flusher = self
        self._lock = threading.Lock()
        self._batch: list[tuple] = []

    def put(self, output: RequestOutput) -> None:
        self.put_wire(encode(output))

    def put_wire(self, wire: tuple) -> None:
        with self._lock:
            self._batch.append(wire)

    def flush(self) -> None:
        with self._lock:
            batch, self._batch = self._batch, []
            if batch:
                stats = self.engine.stats()
                self.conn.send_bytes(pickle.dumps(("outputs", tuple(stats.__dict__.values()), batch), protocol=5))


def child_main(config: EngineConfig, commands: Any, outputs: Any) -> None:
    """The engine process: build, announce, serve commands until told to stop or orphaned."""
    logging.basicConfig(level=logging.WARNING if not config.show_progress else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        engine = Engine(config)
    except BaseException:
        outputs.send_bytes(pickle.dumps(("failed", traceback.format_exc())))
        return
    outputs.send_bytes(pickle.dumps(("ready", engine.info())))
    freeze_heap()  # this process serves the engine it built until it exits
    loop = EngineLoop(engine)
    sink = _PipeSink(outputs, engine)
    try:
        while True:
            try:
                msg = commands.recv()
            except (EOFError, OSError):  # the client is gone
                break
            if not _apply(loop, sink, msg[1] if msg[0] == "batch" else [msg]):
                break
    finally:
        loop.shutdown()
        sink.flush()
        try:
            outputs.send_bytes(pickle.dumps(("bye",)))
        except OSError:
            pass


def _apply(loop: EngineLoop, sink: _PipeSink, commands: list[tuple]) -> bool:
    """Carry out the client's commands in order (the requests of consecutive adds are
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


def _submit(loop: EngineLoop, sink: _PipeSink, requests: list[EngineRequest]) -> None:
    if not requests:
        return
    try:
        loop.submit_all(requests, sink)
    except EngineDeadError as exc:
        for request in requests:
            sink.put_wire(error_wire(request.request_id, request.params.n, str(exc)))
        sink.flush()


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


class EngineProcessClient:
    """Starts the engine process and talks to it from one asyncio event loop."""

    def __init__(self, config: EngineConfig) -> None:
        ctx = multiprocessing.get_context("spawn")  # CUDA must not be forked
        cmd_recv, self._cmd = ctx.Pipe(duplex=False)
        self._out, out_send = ctx.Pipe(duplex=False)
        widen_pipe(out_send.fileno())
        widen_pipe(self._cmd.fileno())
        self._commands = _CommandWriter(self._cmd)
        self.proc = ctx.Process(target=child_main, args=(config, cmd_recv, out_send), name="ingot-engine",
                                daemon=True)
        self.proc.start()
        cmd_recv.close()
        out_send.close()
        try:
            msg = pickle.loads(self._out.recv_bytes())
        except EOFError:
            self.proc.join(5)
            raise EngineStartError(f"the engine process exited while starting (exit code {self.proc.exitcode})") from None
        if msg[0] == "failed":
            self.proc.join(5)
            raise EngineStartError(f"the engine process failed to start:\n{msg[1]}")
        self.info: EngineInfo = msg[1]
        self._stats = EngineStats()
        self._sinks: dict[str, Callable[[RequestOutput], None]] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._dead: Optional[str] = None

    # -------------------------------------------------------------- commands
    def _attach(self) -> None:
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
        self._attach()
        for r in requests:
            self._sinks[r.request_id] = deliver
        self._commands.send(("add", requests))

    def abort(self, request_id: str) -> None:
        if self._dead is None and request_id in self._sinks:
            self._commands.send(("abort", request_id))

    def abort_all(self) -> None:
        if self._dead is None:  # also from a signal handler
            self._commands.send(("abort_all",), threadsafe=True)

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def alive(self) -> bool:
        return self._dead is None and self.proc.is_alive()

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
                if msg[0] == "outputs":
                    self._stats = EngineStats(*msg[1])
                    for wire in msg[2]:
                        backlog.setdefault(wire[0], []).append(wire)
                elif msg[0] == "bye":
                    self._deliver(backlog)
                    self._die("the engine process stopped")
                    return
        except (EOFError, OSError):
            self._deliver(backlog)
            self._die(f"the engine process exited (exit code {self.proc.exitcode})")
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
