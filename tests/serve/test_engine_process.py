"""The server's engine process: it never outlives the server, and its death fails the
requests in flight cleanly (an error chunk, then [DONE]) and turns /health to 503."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import write_tiny_checkpoint
from tests.serve.server_process import running_server, wait_until


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


def engine_of(pid: int) -> int:
    """The server's engine process (its other child is multiprocessing's resource tracker)."""
    (engine,) = [c for c in children(pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return engine


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text().split()
    return stat[2] != "Z"


def test_engine_process_dies_with_a_killed_server(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "llama", "llama")
    with running_server("--model", str(path), "--quiet") as srv:
        engines = children(srv.proc.pid)
        assert engine_of(srv.proc.pid) in engines, "the engine runs in a child process"
        srv.proc.kill()  # no chance to clean up
        srv.proc.wait()
        assert wait_until(lambda: not any(alive(p) for p in engines), 30)


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name in ("ingot:num_requests_running", "ingot:num_requests_waiting", "ingot:kv_cache_usage_perc")}


def test_engine_death_fails_requests_in_flight(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "llama", "llama")
    with running_server("--model", str(path), "--quiet") as srv:
        engine = engine_of(srv.proc.pid)
        body = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.v1 + "/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            assert wait_until(lambda: gauges(srv.url)["ingot:num_requests_running"] == 1, 10)
            os.kill(engine, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2]
        assert wait_until(lambda: httpx.get(srv.url + "/health").status_code == 503, 10)
        # nothing runs, waits or holds KV cache once the engine is gone (its last report said otherwise)
        assert set(gauges(srv.url).values()) == {0.0}
        after = httpx.post(srv.v1 + "/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert after.status_code == 503 and "not running" in after.json()["error"]["message"]
