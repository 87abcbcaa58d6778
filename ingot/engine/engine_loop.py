"""EngineLoop: one background thread owns the engine; any thread submits and aborts.

The loop thread is the only one that touches the scheduler, the runner and the
device after start-up. Callers hand it processed requests (``submit``) with a
sink that receives the request's outputs, and ask it to abort (``abort``,
safe from any thread, any time). Each turn of the loop takes the commands that
arrived, runs one engine step, and hands every output to its request's sink;
it sleeps while there is no work. An abort frees the request's blocks before
the next step.

A sink is any object with ``put(output)``, called in the loop thread. A sink
may also name a ``flusher`` (an object with ``flush()``), called once per turn
after the outputs of that turn were put: the asyncio bridge uses it to wake its
event loop once per step rather than once per output.

``call(fn)`` runs ``fn(engine)`` in the loop thread between two steps and returns
its result to the caller (``LLM.reset_prefix_cache``).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Optional, Protocol, TypeVar


from ingot.engine.engine import Engine
from ingot.engine.request import EngineRequest, RequestError
from ingot.engine.outputs import failed_output
from ingot.outputs import RequestOutput

log = logging.getLogger(__name__)

T = TypeVar("T")


class OutputSink(Protocol):
    def put(self, output: RequestOutput) -> None: ...


class EngineDeadError(RuntimeError):
    """The engine loop has shut down (or died); no request can be served."""


def error_output(request: EngineRequest, message: str) -> RequestOutput:
    """The final output of an admitted-but-failed request."""
    return failed_output(request.request_id, request.prompt, request.prompt_token_ids, request.params.n, message)


class EngineLoop:
    """Runs ``engine`` in a daemon thread started by the first ``submit``."""

    def __init__(self, engine: Engine, name: str = "ingot-engine") -> None:
        self.engine = engine
        self.name = name
        self._cv = threading.Condition()
        self._inbox: deque[tuple[str, Any, Any]] = deque()
        self._sinks: dict[str, OutputSink] = {}
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._dead: Optional[str] = None  # why the loop stopped, once it has

    # ------------------------------------------------------------------ callers
    def submit(self, request: EngineRequest, sink: OutputSink) -> None:
        """Queue ``request``; its outputs go to ``sink`` (an error output if it cannot be added)."""
        self.submit_all([request], sink)

    def submit_all(self, requests: list[EngineRequest], sink: OutputSink) -> None:
        """Queue ``requests`` together: the loop sees all of them before its next step, so a
        batch submitted at once is scheduled the same way every time."""
        with self._cv:
            if self._dead is not None or self._stopping:
                raise EngineDeadError(f"the engine loop is not running: {self._dead or 'shutting down'}")
            self._inbox.extend(("add", request, sink) for request in requests)
            self._ensure_thread()
            self._cv.notify()

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are ignored); safe from any thread."""
        with self._cv:
            if self._dead is None:
                self._inbox.append(("abort", request_id, None))
                self._cv.notify()

    def abort_all(self) -> None:
        """Abort every request in flight; safe from any thread."""
        with self._cv:
            if self._dead is None:
                self._inbox.append(("abort_all", None, None))
                self._cv.notify()

    def call(self, fn: Callable[[Engine], T], timeout: Optional[float] = None) -> T:
        """``fn(engine)`` run in the loop thread between two steps (after the commands
        queued before it); its result, or its exception raised here. EngineDeadError if the
        loop is not running; called from the loop thread itself, ``fn`` runs at once."""
        if threading.current_thread() is self._thread:
            return fn(self.engine)
        future: Future = Future()
        with self._cv:
            if self._dead is not None or self._stopping:
                raise EngineDeadError(f"the engine loop is not running: {self._dead or 'shutting down'}")
            self._inbox.append(("call", fn, future))
            self._ensure_thread()
            self._cv.notify()
        return future.result(timeout)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything in flight (each gets a final output), stop the thread and close
        the engine (its tensor-parallel workers)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self.engine.close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def alive(self) -> bool:
        """Accepting requests: neither shut down nor dead."""
        return self._dead is None and not self._stopping

    # ------------------------------------------------------------------ the loop thread
    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self.engine.executor.make_current()  # a new thread starts on GPU 0
            while True:
                with self._cv:
                    while not self._inbox and not self._sinks and not self._stopping:
                        self._cv.wait()
                    commands = list(self._inbox)
                    self._inbox.clear()
                    stopping = self._stopping
                delivered: list[tuple[OutputSink, RequestOutput]] = []
                for command in commands:
                    self._apply(command, delivered)
                if stopping:
                    self._end_all("the engine is shutting down", delivered)
                    self._deliver(delivered)
                    break
                if self._sinks:
                    self._step(delivered)
                self._deliver(delivered)
        except BaseException as exc:  # a bug in the loop itself: fail everything, loudly
            log.exception("the engine loop died")
            with self._cv:
                self._dead = f"{type(exc).__name__}: {exc}"
            delivered = []
            self._end_all(f"the engine loop died: {self._dead}", delivered)
            self._deliver(delivered)
        finally:
            with self._cv:
                self._dead = self._dead or "shut down"
                pending = list(self._inbox)
                self._inbox.clear()
            for kind, request, sink in pending:  # submitted while it stopped
                if kind == "add":
                    sink.put(error_output(request, f"the engine loop is not running: {self._dead}"))
                elif kind == "call":
                    sink.set_exception(EngineDeadError(f"the engine loop is not running: {self._dead}"))

    def _apply(self, command: tuple[str, Any, Any], delivered: list) -> None:
        kind, item, sink = command
        if kind == "add":
            try:
                self.engine.add(item)
                self._sinks[item.request_id] = sink
            except RequestError as exc:
                delivered.append((sink, error_output(item, str(exc))))
            except Exception as exc:
                log.exception("adding request %s failed", item.request_id)
                delivered.append((sink, error_output(item, f"{type(exc).__name__}: {exc}")))
        elif kind == "call":
            try:
                sink.set_result(item(self.engine))
            except Exception as exc:  # the caller's to handle
                sink.set_exception(exc)
        elif kind == "abort_all":
            for rid in list(self._sinks):
                self._apply(("abort", rid, None), delivered)
        else:
            sink = self._sinks.get(item)
            if sink is None:
                return
            try:
                out = self.engine.abort(item)
            except Exception as exc:
                log.exception("aborting request %s failed", item)
                out = None
                self._forget_broken(item, f"abort failed: {type(exc).__name__}: {exc}", delivered)
            if out is not None:
                delivered.append((self._sinks.pop(item), out))

    def _step(self, delivered: list) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # the engine guards its step; this is a bug: fail what runs, go on
            log.exception("an engine step failed")
            self._end_all(f"internal error in the engine step: {type(exc).__name__}: {exc}", delivered)
            return
        for out in outputs:
            sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
            if sink is not None:
                delivered.append((sink, out))

    def _end_all(self, reason: str, delivered: list) -> None:
        """Finish every request in flight with ``reason`` as its error."""
        for rid in list(self._sinks):
            try:
                out = self.engine.fail(rid, reason)
            except Exception:
                log.exception("ending request %s failed", rid)
                out = None
            if out is None:
                self._forget_broken(rid, reason, delivered)
            else:
                delivered.append((self._sinks.pop(rid), out))

    def _forget_broken(self, rid: str, reason: str, delivered: list) -> None:
        state = self.engine.requests.pop(rid, None)
        sink = self._sinks.pop(rid, None)
        if sink is not None and state is not None:
            delivered.append((sink, error_output(state.request, reason)))

    @staticmethod
    def _deliver(delivered: list[tuple[OutputSink, RequestOutput]]) -> None:
        flushers = {}
        for sink, out in delivered:
            try:
                sink.put(out)
            except Exception:  # a consumer's problem stays the consumer's
                log.exception("delivering an output of request %s failed", out.request_id)
            flusher = getattr(sink, "flusher", None)
            if flusher is not None:
                flushers[id(flusher)] = flusher
        for flusher in flushers.values():
            try:
                flusher.flush()
            except Exception:
                log.exception("waking an output consumer failed")
