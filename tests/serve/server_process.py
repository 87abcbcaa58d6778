"""Start `ingot serve` as a real process on a free port, and always tear it down."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

READY = re.compile(r"ready on (http://\S+) ")


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    log: list[str] = field(default_factory=list)

    @property
    def v1(self) -> str:
        return self.url + "/v1"


@contextlib.contextmanager
def running_server(*args: str, timeout: float = 240.0, env: dict | None = None) -> Iterator[ServerProcess]:
    """`python -m ingot serve --port 0 --device cpu ARGS`, ready; SIGTERM on exit (it must exit 0)."""
    cmd = [sys.executable, "-m", "ingot", "serve", "--port", "0", "--device", "cpu", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    log: list[str] = []
    ready = threading.Event()
    found: list[str] = []

    def pump() -> None:
        for line in proc.stderr:  # keep reading, or a full pipe would block the server
            log.append(line)
            m = READY.search(line)
            if m and not found:
                found.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        if not ready.wait(timeout) or not found:
            raise RuntimeError("ingot serve did not become ready:\n" + "".join(log[-40:]))
        server = ServerProcess(found[0], proc, log)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_until(predicate, timeout: float = 30.0, every: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return predicate()
