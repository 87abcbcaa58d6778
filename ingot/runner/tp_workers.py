"""WorkerGroup: the driver's view of its tensor-parallel worker processes.

Spawns one process per rank 1 .. size - 1 (``multiprocessing`` spawn: CUDA
cannot be forked), daemonic, each with a status pipe (worker -> driver) and a
lifeline pipe (the driver holds the only write end: when the driver exits for
any reason, the worker's read end sees EOF and the worker ends). A monitor
thread reads the status pipes and watches the processes: the first error (a
worker's traceback text) or unexpected exit is recorded as the group's
``failure`` and handed to ``on_failure`` (the driver aborts NCCL collectives
that wait on the dead rank; gloo's fail by themselves when its sockets close).
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from multiprocessing import connection
from typing import Any, Callable, Optional

from ingot.runner.tp_worker import WorkerSpec, worker_main

log = logging.getLogger(__name__)


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker failed (the message holds its traceback), or the group is down."""


class WorkerGroup:
    def __init__(self, spec: WorkerSpec, on_failure: Optional[Callable[[str], None]] = None) -> None:
        self.spec = spec
        self.on_failure = on_failure
        ctx = multiprocessing.get_context("spawn")
        me = multiprocessing.current_process()
        if me.daemon:  # the engine process of `ingot serve` is daemonic; its workers die with it (lifeline)
            me.daemon = False
        self.procs: dict[int, Any] = {}
        self.status: dict[int, Any] = {}
        self.lifelines: dict[int, Any] = {}
        self._cv = threading.Condition()
        self._seen: dict[str, set[int]] = {}
        self.failure: Optional[str] = None
        self._closing = False
        self._wake_r, self._wake_w = ctx.Pipe(duplex=False)
        try:
            for rank in range(1, spec.size):
                status_r, status_w = ctx.Pipe(duplex=False)
                life_r, life_w = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=worker_main, args=(rank, spec, status_w, life_r), name=f"ingot-tp{rank}", daemon=True)
                proc.start()
                status_w.close()
                life_r.close()
                self.procs[rank], self.status[rank], self.lifelines[rank] = proc, status_r, life_w
        except BaseException:
            self.stop(0.0)
            raise
        self._monitor = threading.Thread(target=self._watch, name="ingot-tp-monitor", daemon=True)
        self._monitor.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    # ------------------------------------------------------------------ start-up
    def wait_for(self, event: str, timeout: Optional[float] = None) -> None:
        """Block until every worker has reported ``event``; TensorParallelError if one failed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while len(self._seen.get(event, ())) < len(self.procs):
                if self.failure is not None:
                    raise TensorParallelError(self.failure)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TensorParallelError(f"tensor-parallel workers did not report {event!r} within {timeout:.0f} s")
                self._cv.wait(left)

    def wait_failure(self, timeout: float) -> Optional[str]:
        """The group's failure, waiting up to ``timeout`` for one to be reported."""
        with self._cv:
            self._cv.wait_for(lambda: self.failure is not None, timeout)
            return self.failure

    def alive(self) -> bool:
        return self.failure is None and all(p.is_alive() for p in self.procs.values())

    # ------------------------------------------------------------------ monitor
    def _watch(self) -> None:
        waiting: dict[Any, tuple[str, int]] = {self._wake_r: ("wake", 0)}
        for rank, proc in self.procs.items():
            waiting[self.status[rank]] = ("status", rank)
            waiting[proc.sentinel] = ("exit", rank)
        while len(waiting) > 1:
            for obj in connection.wait(list(waiting)):
                what, rank = waiting[obj]
                if what == "wake":
                    return
                if what == "status":
                    if not self._read(rank):
                        del waiting[obj]
                    continue
                del waiting[obj]
                while self.status[rank].poll() and self._read(rank):  # what it said before it exited first
                    pass
                if rank not in self._seen.get("stopped", ()):
                    self._fail(f"tensor-parallel worker {rank} exited unexpectedly (exit code {self.procs[rank].exitcode})")

    def _read(self, rank: int) -> bool:
        """Handle one message of worker ``rank``; False once its pipe is closed."""
        try:
            msg = self.status[rank].recv()
        except (EOFError, OSError):
            return False
        if msg[0] == "error":
            self._fail(f"tensor-parallel worker {rank} failed:\n{msg[2]}")
        else:
            with self._cv:
                self._seen.setdefault(msg[0], set()).add(rank)
                self._cv.notify_all()
        return True

    def expect_exit(self) -> None:
        """The driver is about to stop the workers: their exits are no failures."""
        with self._cv:
            self._closing = True

    def _fail(self, message: str) -> None:
        with self._cv:
            if self.failure is not None or self._closing:
                return
            self.failure = message
            self._cv.notify_all()
        log.error("%s", message)
        if self.on_failure is not None:
            try:
                self.on_failure(message)
            except Exception:
                log.exception("reacting to a tensor-parallel worker failure failed")

    # ------------------------------------------------------------------ shutdown
    def stop(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the workers to exit on their own, then end them; no process
        outlives this call. Closing the lifelines makes any worker still running exit."""
        self.expect_exit()
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for life in self.lifelines.values():
            life.close()
        for proc in self.procs.values():
            proc.join(5.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        try:
            self._wake_w.send(None)
        except OSError:
            pass
        monitor = getattr(self, "_monitor", None)
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(5.0)
        for conn in (*self.status.values(), self._wake_w, self._wake_r):
            conn.close()
