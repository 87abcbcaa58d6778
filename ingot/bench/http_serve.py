"""`ingot bench serve --url`: the serving benchmark's workload sent to an OpenAI-compatible server.

Each request is a streamed ``POST /v1/completions`` with the workload's prompt
token ids, ``max_tokens`` = its output length, ``ignore_eos`` and greedy
sampling, sent at its arrival time (all at once, or Poisson arrivals) or with
at most ``max_concurrency`` requests open. Per request the client records the
send time and the arrival time of every streamed chunk that carries text;
output tokens are the server's ``usage.completion_tokens`` (the last chunk,
``stream_options.include_usage``), or the count of text chunks when the server
sends no usage. From these, as ``vllm bench serve`` reports them: throughput,
TTFT (send to first text), TPOT ((latency - TTFT) / (output tokens - 1)) and
ITL (every gap between two chunks). Against an ingot server the client also reads
``GET /metrics`` before and after the run: the engine's preemptions, prefix-cache
hits, prefill and decode steps and mean decode batch over the run, as the offline
benchmark reports them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from ingot.bench.serve import RequestRecord, ServeMetrics, add_engine_counters, compute_metrics
from ingot.bench.workload import Request
from ingot.engine.stats import EngineStats


@dataclass
class HttpResult:
    record: RequestRecord
    error: Optional[str] = None


@dataclass
class HttpServeMetrics:
    """ServeMetrics plus what only the HTTP client measures."""

    metrics: ServeMetrics
    failed: int = 0
    errors: list[str] = field(default_factory=list)  # the first few
    server: dict = field(default_factory=dict)  # what the server says of itself (server_info)


async def discover_model(session, base: str, headers: dict) -> str:
    """The first model the server lists (``GET /v1/models``)."""
    async with session.get(base + "/v1/models", headers=headers) as r:
        r.raise_for_status()
        data = (await r.json()).get("data") or []
    if not data:
        raise RuntimeError(f"{base}/v1/models lists no model")
    return data[0]["id"]


async def server_info(session, base: str, headers: dict, model: Optional[str]) -> dict:
    """What the server says of itself: the model's ``id`` and ``max_model_len`` (from ``GET
    /v1/models``, where it lists them) and the server's ``version`` (``GET /version``, vLLM's
    and ingot's route); what it does not say is left out."""
    info: dict = {}
    try:
        async with session.get(base + "/v1/models", headers=headers) as r:
            data = ((await r.json()).get("data") or []) if r.status == 200 else []
        card = next((m for m in data if m.get("id") == model), data[0] if data else {})
        info.update({k: card[k] for k in ("id", "max_model_len") if card.get(k) is not None})
        async with session.get(base + "/version", headers=headers) as r:
            version = (await r.json()).get("version") if r.status == 200 else None
        if version:
            info["version"] = version
    except Exception:  # noqa: BLE001 - any server, any answer: the header just says less
        pass
    return info


def parse_engine_stats(text: str) -> Optional[EngineStats]:
    """The engine counters in an ingot server's Prometheus text (``ingot:<field>_total`` of
    EngineStats' counter fields; None when it has none of them: another server)."""
    from prometheus_client.parser import text_string_to_metric_families

    counters = {f.name for f in dataclasses.fields(EngineStats)}  # gauges carry no _total
    values: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix("ingot:").removesuffix("_total")
            if sample.name.startswith("ingot:") and sample.name.endswith("_total") and name in counters:
                values[name] = values.get(name, 0) + int(sample.value)
    return EngineStats(**values) if values else None


async def scrape_engine_stats(session, base: str, headers: dict) -> Optional[EngineStats]:
    """``GET /metrics`` of the server, parsed by ``parse_engine_stats``; None when the server
    has no such endpoint or it fails."""
    try:
        async with session.get(base + "/metrics", headers=headers) as r:
            if r.status != 200:
                return None
            return parse_engine_stats(await r.text())
    except Exception:  # noqa: BLE001 - any server, any answer: the counters are optional
        return None


async def _one(session, base: str, headers: dict, model: str, req: Request, clock: Callable[[], float]) -> HttpResult:
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    times: list[float] = []
    usage_tokens: Optional[int] = None
    sent = clock()
    try:
        async with session.post(base + "/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                text = (await r.read()).decode(errors="replace")
                return HttpResult(RequestRecord(len(req.prompt_token_ids), 0, sent, []), f"HTTP {r.status}: {text[:200]}")
            buf = b""
            async for data in r.content.iter_any():  # server-sent events, split however TCP delivers them
                buf += data
                *events, buf = buf.split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    chunk = json.loads(event[6:])
                    if chunk.get("error"):
                        return HttpResult(RequestRecord(len(req.prompt_token_ids), 0, sent, times), str(chunk["error"])[:200])
                    if any(c.get("text") for c in chunk.get("choices") or ()):
                        times.append(clock())  # per event, as vllm bench serve stamps them
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"].get("completion_tokens")
    except Exception as exc:  # a broken connection is that request's failure
        return HttpResult(RequestRecord(len(req.prompt_token_ids), 0, sent, times), f"{type(exc).__name__}: {exc}")
    out_len = usage_tokens if usage_tokens is not None else len(times)
    return HttpResult(RequestRecord(len(req.prompt_token_ids), out_len, sent, times))


async def _send_all(session, base: str, headers: dict, model: str, requests: Sequence[Request], start: float,
                    max_concurrency: Optional[int], clock: Callable[[], float],
                    on_finish: Optional[Callable[[], None]] = None) -> list[HttpResult]:
    """Each request sent at ``start + arrival_s`` (with at most ``max_concurrency`` open)."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def send(req: Request) -> HttpResult:
        delay = start + req.arrival_s - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is None:
            result = await _one(session, base, headers, model, req, clock)
        else:
            async with gate:
                result = await _one(session, base, headers, model, req, clock)
        if on_finish is not None:
            on_finish()
        return result

    return list(await asyncio.gather(*(send(r) for r in requests)))


def _session(max_concurrency: Optional[int]):
    import aiohttp

    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)  # 0: a connection per open request
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=60))


async def _worker_main(conn, base: str, headers: dict, model: str, requests: Sequence[Request],
                       max_concurrency: Optional[int]) -> None:
    async with _session(max_concurrency) as session:
        conn.send("ready")
        start = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        results = await _send_all(session, base, headers, model, requests, start, max_concurrency, time.monotonic)
    conn.send((results, time.monotonic()))


def client_worker(conn, base: str, headers: dict, model: str, requests: Sequence[Request],
                  max_concurrency: Optional[int]) -> None:
    """One client process of ``run_http(client_processes=N)``: says ready once its session is
    open, sends its requests from the start time it is given, returns its results and its end."""
    from ingot.engine import event_loop
    from ingot.engine.heap import freeze_heap

    freeze_heap()  # as the server's processes: its collector stays out of the chunks' bursts
    try:
        event_loop.run(_worker_main(conn, base, headers, model, requests, max_concurrency))
    finally:
        conn.close()


async def _send_from_processes(base: str, headers: dict, model: str, requests: Sequence[Request],
                               max_concurrency: Optional[int], processes: int) -> tuple[list[HttpResult], float, float]:
    """The requests dealt round-robin to ``processes`` client processes (each with
    ``max_concurrency / processes`` open at most, rounded up), started together on the
    shared monotonic clock; (results, start, end)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold a GPU or threads
    share = -(-max_concurrency // processes) if max_concurrency else None
    workers, pipes = [], []
    for k in range(processes):
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=client_worker, args=(theirs, base, headers, model, list(requests[k::processes]), share),
                           name=f"ingot-bench-client-{k}", daemon=True)
        proc.start()
        theirs.close()
        workers.append(proc)
        pipes.append(mine)
    loop = asyncio.get_running_loop()
    try:
        for conn in pipes:
            if await loop.run_in_executor(None, conn.recv) != "ready":
                raise RuntimeError("a client process did not start")
        start = time.monotonic() + 0.05
        for conn in pipes:
            conn.send(start)
        results: list[HttpResult] = []
        end = start
        for conn in pipes:
            got, ended = await loop.run_in_executor(None, conn.recv)
            results += got
            end = max(end, ended)
    except EOFError:
        raise RuntimeError("a client process exited before it reported its results") from None
    finally:
        for proc in workers:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return results, start, end


async def run_http(
    base_url: str,
    requests: Sequence[Request],
    model: Optional[str] = None,
    api_key: Optional[str] = None,
    max_concurrency: Optional[int] = None,
    on_finish: Optional[Callable[[], None]] = None,
    client_processes: int = 1,
) -> HttpServeMetrics:
    """Send ``requests`` to the server at ``base_url`` (no ``/v1``), measure, aggregate.

    aiohttp, as ``vllm bench serve`` uses. One process reads about 28,000 streamed chunks/s
    at most (its event loop's socket reads and wake-ups, then the JSON); past that the client,
    not the server, sets the measured latencies. ``client_processes`` N > 1 deals the requests
    round-robin to N processes (``on_finish`` is then not called)."""
    base = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    clock = time.monotonic  # one clock for every process (system-wide on Linux, macOS and Windows)
    async with _session(None) as session:
        name = model or await discover_model(session, base, headers)
        info = await server_info(session, base, headers, name)
        before = await scrape_engine_stats(session, base, headers)
    if client_processes > 1:
        results, start, end = await _send_from_processes(base, headers, name, requests, max_concurrency, client_processes)
    else:
        async with _session(max_concurrency) as session:
            start = clock()
            results = await _send_all(session, base, headers, name, requests, start, max_concurrency, clock, on_finish)
            end = clock()
    if before is not None:
        async with _session(None) as session:
            after = await scrape_engine_stats(session, base, headers)
    else:
        after = None
    ok = [r.record for r in results if r.error is None]
    failed = [r.error for r in results if r.error is not None]
    if not ok:
        raise RuntimeError(f"every request failed; first error: {failed[0] if failed else '?'}")
    metrics = compute_metrics(ok, start, end)
    if before is not None and after is not None:  # an ingot server: its engine's steps over the run
        add_engine_counters(metrics, before, after)
    return HttpServeMetrics(metrics, len(failed), failed[:5], info)
