"""`ingot serve --api-server-count 2`: two API server processes over one engine process,
driven by the official `openai` client: answers equal the offline engine's, connections land
on both processes, /metrics sums them, a client that leaves frees its blocks, SIGTERM stops
every process, and an engine that dies turns every API server to 503."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path

import httpx
import openai
import pytest

from ingot import LLM, SamplingParams
from ingot.cli import main
from tests.helpers import write_tiny_checkpoint
from tests.serve.server_process import running_server, wait_until
from tests.serve.test_engine_process import alive, children, gauges
from tests.serve.test_openai_server import metrics

WORDS = "the sea river mountain code python garden music history science light".split()


def sockets(pid: int) -> int:
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except OSError:  # closed meanwhile
            pass
    return count


def api_servers(pid: int) -> list[int]:
    """The server's children that hold sockets: its API servers (the engine has pipes only)."""
    return [c for c in children(pid) if sockets(c) > 0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # room for long streams: they still run when their clients leave
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama",
                                 overrides={"max_position_embeddings": 4096})


@pytest.fixture(scope="module")
def server(checkpoint):
    # at most 32 requests in flight, counted across both API servers
    with running_server("--model", str(checkpoint), "--api-server-count", "2", "--max-num-seqs", "32",
                        "--max-queued-requests", "0", "--quiet") as srv:
        pids = [srv.proc.pid, *children(srv.proc.pid)]
        assert len(api_servers(srv.proc.pid)) == 2
        yield srv
    assert srv.proc.returncode == 0, "".join(srv.log[-20:])
    assert wait_until(lambda: not any(alive(p) for p in pids), 30), "SIGTERM stops every process"


def test_concurrent_requests_equal_offline_on_both_api_servers(server, checkpoint):
    jobs = [(" ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(2 + i % 9)), 4 + i % 13, i % 2 == 0)
            for i in range(32)]
    offline = LLM(model=str(checkpoint), device="cpu", show_progress=False)
    try:
        expected = [o.outputs[0].text for o in offline.generate(
            [p for p, _, _ in jobs], [SamplingParams(temperature=0.0, max_tokens=n) for _, n, _ in jobs], use_tqdm=False)]
    finally:
        offline.shutdown()
    workers = api_servers(server.proc.pid)
    before = {pid: sockets(pid) for pid in workers}
    seen = metrics(server)
    clients = [openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0, timeout=60) for _ in jobs]
    texts: list = [None] * len(jobs)

    def run(i: int) -> None:
        prompt, n, stream = jobs[i]
        try:
            out = clients[i].completions.create(model="llama", prompt=prompt, max_tokens=n, temperature=0, stream=stream)
            texts[i] = "".join(c.choices[0].text for c in out if c.choices) if stream else out.choices[0].text
        except Exception as exc:  # compared below
            texts[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert texts == expected
        # each client keeps its connection open: some landed on each API server
        assert all(sockets(pid) > before[pid] for pid in workers), {pid: (before[pid], sockets(pid)) for pid in workers}
    finally:
        for c in clients:
            c.close()
    # whichever API server answers, /metrics counts the requests both served
    for _ in range(4):
        m = metrics(server)
        assert m["ingot:e2e_request_latency_seconds_count"] - seen["ingot:e2e_request_latency_seconds_count"] == len(jobs)
        assert m["ingot:num_requests_running"] == 0


def test_models_and_health(server):
    for _ in range(4):  # a new connection each: either API server
        assert [m["id"] for m in httpx.get(server.v1 + "/models").json()["data"]] == ["llama"]
        assert httpx.get(server.url + "/health").status_code == 200


def test_clients_that_leave_free_their_blocks(server):
    body = {"model": "llama", "prompt": "the sea", "max_tokens": 4000, "ignore_eos": True, "temperature": 0, "stream": True}
    before = metrics(server)["ingot:generation_tokens_total"]
    with contextlib.ExitStack() as stack:  # a connection each: both API servers
        streams = [stack.enter_context(httpx.stream("POST", server.v1 + "/completions", json=body, timeout=60))
                   for _ in range(4)]
        lines = [r.iter_lines() for r in streams]  # kept: a collected iterator closes its connection
        for it in lines:
            next(it)
        assert gauges(server.url)["ingot:num_requests_running"] == 4
    # the engine's stats reach both API servers, one without requests of its own too
    assert wait_until(lambda: all(set(gauges(server.url).values()) == {0.0} for _ in range(4)), 30), gauges(server.url)
    assert metrics(server)["ingot:generation_tokens_total"] - before < 4 * 4000, "aborted, not run to the end"


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_bad_count_is_a_clear_error(value, capsys):
    assert main(["serve", "--api-server-count", value]) == 2
    assert f"--api-server-count must be at least 1 (got {value})" in capsys.readouterr().err


def test_the_queue_limit_holds_across_api_servers(server):
    body = {"model": "llama", "prompt": "the sea", "max_tokens": 4000, "ignore_eos": True, "temperature": 0, "stream": True}
    with contextlib.ExitStack() as stack:
        streams = [stack.enter_context(httpx.stream("POST", server.v1 + "/completions", json=body, timeout=60))
                   for _ in range(32)]
        lines = [r.iter_lines() for r in streams]
        for it in lines:
            next(it)
        busy = [httpx.post(server.v1 + "/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
                for _ in range(6)]  # new connections: both API servers
        assert [b.status_code for b in busy] == [503] * 6 and busy[0].json()["error"]["code"] == "queue_full"
    assert wait_until(lambda: all(set(gauges(server.url).values()) == {0.0} for _ in range(4)), 30), gauges(server.url)
    assert httpx.post(server.v1 + "/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code == 200


def test_engine_death_turns_every_api_server_to_503(server):
    """Last in this module: the engine stays dead; the fixture then checks SIGTERM still stops everything."""
    body = {"model": "llama", "prompt": "hello", "max_tokens": 4000, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        engine = next(c for c in children(server.proc.pid) if c not in api_servers(server.proc.pid)
                      and b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes())
        os.kill(engine, signal.SIGKILL)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2]
    clients = [httpx.Client(timeout=30) for _ in range(8)]  # a connection each: both API servers
    try:
        assert wait_until(lambda: all(c.get(server.url + "/health").status_code == 503 for c in clients), 10)
        assert all(set(gauges(server.url).values()) == {0.0} for _ in range(4))
    finally:
        for c in clients:
            c.close()
