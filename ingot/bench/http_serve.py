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


async def run_http(
    base_url: str,
    requests: Sequence[Request],
    model: Optional[str] = None,
    api_key: Optional[str] = None,
    max_concurrency: Optional[int] = None,
    on_finish: Optional[Callable[[], None]] = None,
) -> HttpServeMetrics:
    """Send ``requests`` to the server at ``base_url`` (no ``/v1``), measure, aggregate.

    aiohttp, as ``vllm bench serve`` uses: at 10,000+ streamed chunks per second the
    client must not be what limits the measurement."""
    import aiohttp

    base = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)  # 0: a connection per open request
    clock = time.monotonic
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        name = model or await discover_model(session, base, headers)
        info = await server_info(session, base, headers, name)
        before = await scrape_engine_stats(session, base, headers)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        start = clock()

        async def send(req: Request) -> HttpResult:
            delay = start + req.arrival_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            if gate is None:
                result = await _one(session, base, headers, name, req, clock)
            else:
                async with gate:
                    result = await _one(session, base, headers, name, req, clock)
            if on_finish is not None:
                on_finish()
            return result

        results = await asyncio.gather(*(send(r) for r in requests))
        end = clock()
        after = await scrape_engine_stats(session, base, headers) if before is not None else None
    ok = [r.record for r in results if r.error is None]
    failed = [r.error for r in results if r.error is not None]
    if not ok:
        raise RuntimeError(f"every request failed; first error: {failed[0] if failed else '?'}")
    metrics = compute_metrics(ok, start, end)
    if before is not None and after is not None:  # an ingot server: its engine's steps over the run
        add_engine_counters(metrics, before, after)
    return HttpServeMetrics(metrics, len(failed), failed[:5], info)
