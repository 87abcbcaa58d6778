"""Serving benchmark: end-to-end throughput and latency on a synthetic workload.

The workload (``ingot/bench/workload.py``) is a list of requests with arrival times.
The driver adds each request to the engine once its arrival time has passed and
steps the engine in between. The engine's prefix cache hit rate over the run is
reported (cached prompt tokens / prompt tokens), and speculative decoding's drafts
and the tokens kept, summed from each request's ``RequestOutput.metrics``.

Metrics (pure functions, tested on hand-made streams):

* TTFT: first output token time minus the request's *scheduled* arrival time
  (so time spent waiting for a running step to end counts, as a client would see it).
* ITL: every gap between consecutive output tokens of a request, pooled over requests.
* throughput: requests, output tokens and prompt + output tokens per second of
  ``duration`` (start of the run to the last token).

Rounds: the same workload run several times on one engine (``ingot bench serve
--repeat``) is summed up by its median round (``median_round``) and each round's
headline numbers (``round_summary``).

Structured outputs: with ``structured`` (``ingot bench serve --json-schema FILE``) every
request's output is constrained by that JSON schema; a request ends when its JSON is
complete (or at its output length), and the outputs that do not validate are counted
(``schema_failures``: cut off by the length, or a grammar gap).
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, TypeVar

from ingot.bench.workload import SPECIAL_MARGIN, Request, check_fits
from ingot.engine.stats import EngineStats
from ingot.sampling_params import SamplingParams, StructuredOutputsParams

PERCENTILES = (50, 90, 99)
T = TypeVar("T")


# ---------------------------------------------------------------- metrics (pure)
def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks.

    Rank ``q/100 * (n-1)`` in the sorted values; the same definition as
    numpy's default ("linear"). Raises ValueError on an empty sequence.
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    s = sorted(values)
    rank = q / 100 * (len(s) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, Optional[float]]:
    """mean, p50, p90, p99 of ``values`` times ``scale``; all None when empty."""
    keys = ["mean"] + [f"p{q}" for q in PERCENTILES]
    if not values:
        return dict.fromkeys(keys)
    out: dict[str, Optional[float]] = {"mean": sum(values) / len(values) * scale}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q) * scale
    return out


def ttft(arrival: float, token_times: Sequence[float]) -> Optional[float]:
    """Time to first token (None if the request produced no token)."""
    return token_times[0] - arrival if token_times else None


def inter_token_latencies(token_times: Sequence[float]) -> list[float]:
    """Gaps between consecutive output tokens of one request."""
    return [b - a for a, b in zip(token_times, token_times[1:])]


@dataclass(frozen=True)
class SpecCounts:
    """Speculative decoding over some requests: verify steps with drafts, drafted tokens,
    the drafted tokens kept (``RequestOutput.metrics``' ``spec_*`` counts, or the engine's)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def __add__(self, other: "SpecCounts") -> "SpecCounts":
        return SpecCounts(self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
                          self.accepted_tokens + other.accepted_tokens)

    @classmethod
    def of(cls, metrics: Any) -> "SpecCounts":
        """A request's counts (a ``RequestMetrics``; None: none)."""
        if metrics is None:
            return cls()
        return cls(metrics.spec_num_drafts, metrics.spec_num_draft_tokens, metrics.spec_num_accepted_tokens)

    def fields(self) -> dict[str, Any]:
        """As ``ServeMetrics`` fields: the counts, the acceptance rate (kept / drafted) and
        the mean accepted length (kept per draft; each verify step emits one token more)."""
        return {"spec_num_drafts": self.drafts, "spec_num_draft_tokens": self.draft_tokens,
                "spec_num_accepted_tokens": self.accepted_tokens,
                "spec_acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
                "spec_mean_accepted_length": self.accepted_tokens / self.drafts if self.drafts else None}


@dataclass
class RequestRecord:
    """One finished request: lengths and absolute (monotonic) times."""

    input_len: int
    output_len: int  # tokens produced
    arrival: float
    token_times: list[float]
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    spec: SpecCounts = field(default_factory=lambda: SpecCounts())  # speculation's drafts and the tokens kept

    @property
    def ttft(self) -> Optional[float]:
        return ttft(self.arrival, self.token_times)

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first (None with fewer than 2 tokens)."""
        if self.output_len < 2 or not self.token_times:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.output_len - 1)


@dataclass
class ServeMetrics:
    duration_s: float
    num_requests: int
    input_tokens: int
    output_tokens: int
    request_throughput: float  # requests/s
    output_throughput: float  # output tokens/s
    total_throughput: float  # (prompt + output) tokens/s
    ttft_ms: dict[str, Optional[float]]
    itl_ms: dict[str, Optional[float]]
    tpot_ms: dict[str, Optional[float]] = field(default_factory=dict)  # time per output token after the first
    num_preemptions: int = 0  # sequences evicted (and later recomputed) for lack of KV cache
    # prompt tokens looked up in / served from the prefix cache (0 / 0 with caching off)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_hit_rate: Optional[float] = None
    # the engine's steps in the run: how often prompts interrupted decoding, how full decode ran
    prefill_steps: int = 0
    decode_steps: int = 0
    mean_decode_batch: Optional[float] = None
    # structured outputs (a JSON schema): outputs that do not validate, and the first one's problem
    schema_failures: Optional[int] = None
    schema_failure: Optional[str] = None
    # speculative decoding: verify steps with drafts, drafted tokens, the tokens kept, kept /
    # drafted, kept per draft (None without drafts)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_acceptance_rate: Optional[float] = None
    spec_mean_accepted_length: Optional[float] = None
    requests: list[dict] = field(default_factory=list)  # per request: lengths, arrival, ttft, latency


def compute_metrics(records: Sequence[RequestRecord], start: float, end: float) -> ServeMetrics:
    """Aggregate per-request records of a run that went from ``start`` to ``end``."""
    duration = end - start
    if duration <= 0:
        raise ValueError(f"run duration must be positive, got {duration}")
    inp = sum(r.input_len for r in records)
    out = sum(r.output_len for r in records)
    ttfts = [t for t in (r.ttft for r in records) if t is not None]
    itls = [g for r in records for g in inter_token_latencies(r.token_times)]
    tpots = [t for t in (r.tpot for r in records) if t is not None]
    per_request = [
        {
            "input_len": r.input_len,
            "output_len": r.output_len,
            "arrival_s": r.arrival - start,
            "ttft_ms": None if r.ttft is None else r.ttft * 1e3,
            "latency_s": (r.token_times[-1] - r.arrival) if r.token_times else None,
            "cached_tokens": r.cached_tokens,
            "spec_num_draft_tokens": r.spec.draft_tokens,
            "spec_num_accepted_tokens": r.spec.accepted_tokens,
        }
        for r in records
    ]
    return ServeMetrics(
        duration_s=duration,
        num_requests=len(records),
        input_tokens=inp,
        output_tokens=out,
        request_throughput=len(records) / duration,
        output_throughput=out / duration,
        total_throughput=(inp + out) / duration,
        ttft_ms=summarize(ttfts, 1e3),
        itl_ms=summarize(itls, 1e3),
        tpot_ms=summarize(tpots, 1e3),
        requests=per_request,
        **sum((r.spec for r in records), SpecCounts()).fields(),
    )


def round_order(runs: Sequence[T], r: int) -> list[T]:
    """``runs`` as given in even rounds, reversed in odd ones: over two rounds each runs as
    often first as second, so a machine that drifts within a round favours neither."""
    return list(runs) if r % 2 == 0 else list(reversed(runs))


def median_round(runs: Sequence[ServeMetrics]) -> int:
    """Index of the run with the median duration (the shorter of the two middle ones for
    an even count); ties keep the earlier run."""
    if not runs:
        raise ValueError("median of no runs")
    order = sorted(range(len(runs)), key=lambda i: (runs[i].duration_s, i))
    return order[(len(runs) - 1) // 2]


def round_summary(m: ServeMetrics) -> dict:
    """The headline numbers of one round, kept for every round of a repeated run."""
    return {"duration_s": m.duration_s, "output_throughput": m.output_throughput,
            "ttft_p50_ms": m.ttft_ms["p50"], "itl_p50_ms": m.itl_ms["p50"], "tpot_p50_ms": m.tpot_ms.get("p50"),
            "output_tokens": m.output_tokens, "prefix_cache_hit_rate": m.prefix_cache_hit_rate}


# ---------------------------------------------------------------- driving the engine
def sampling_params(output_len: int, structured: Optional[StructuredOutputsParams] = None) -> SamplingParams:
    return SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0, structured_outputs=structured)


def schema_failures(texts: Sequence[str], schema: dict) -> tuple[int, Optional[str]]:
    """How many of ``texts`` are not JSON that ``schema`` accepts, and the first problem
    (with jsonschema installed; without it, only that each parses as JSON)."""
    try:
        import jsonschema
    except ImportError:  # the test extra has it
        jsonschema = None
    failures, first = 0, None
    for text in texts:
        try:
            value = json.loads(text)
            if jsonschema is not None:
                jsonschema.validate(value, schema)
        except Exception as exc:  # json's ValueError, jsonschema's ValidationError / SchemaError
            failures += 1
            first = first or f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return failures, first


def warm_up(engine, num_prompt: int = 8, num_output: int = 8, structured: Optional[StructuredOutputsParams] = None) -> float:
    """Run one small request to completion (and the engine to idle: no step left in
    flight); returns its wall time in seconds. With ``structured``, constrained by it, so
    xgrammar is loaded and the grammar compiled (and cached) before the run."""
    vocab = engine.model_config.vocab_size
    prompt = [SPECIAL_MARGIN + i % max(1, vocab - 2 * SPECIAL_MARGIN) for i in range(num_prompt)]
    t0 = time.perf_counter()
    seq = engine.add_request(prompt, sampling_params(num_output, structured), request_id="serve-warmup")
    try:
        while not seq.finished or engine.has_unfinished():
            engine.step()
    finally:
        engine.requests.pop(seq.request_id, None)
    return time.perf_counter() - t0


def run_workload(
    engine,
    requests: Sequence[Request],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    on_finish: Optional[Callable[[], None]] = None,
    structured: Optional[StructuredOutputsParams] = None,
) -> ServeMetrics:
    """Send ``requests`` at their arrival times, step until all finish, measure.

    A request with ``next_turns`` sends its next turn (``Request.follow_up``) as soon
    as a step reports it finished; every turn is one request in the metrics.
    ``clock`` must be the clock the engine stamps token times with (time.monotonic).
    ``on_finish`` is called once per finished request (progress display).
    ``structured``: every output is constrained by it; a JSON schema's failures are counted.
    """
    if engine.has_unfinished():
        raise RuntimeError("the engine has unfinished requests; run the benchmark on an idle engine")
    check_fits(requests, engine.max_model_len)
    # (arrival, tie-break, request id, request): ties keep the given order, as a stable sort
    # would; turn k > 0 of conversation i is request "serve-i.k"
    pending = [(r.arrival_s, i, f"serve-{i}", r) for i, r in enumerate(requests)]
    heapq.heapify(pending)
    order = itertools.count(len(requests))
    live = []  # (request, sequence, scheduled arrival time)
    sent: dict[str, tuple[Request, object]] = {}  # request id -> (request, its sequence)
    spec: dict[str, SpecCounts] = {}  # request id -> its speculation counts, from its final output
    before = engine.stats()
    start = clock()
    try:
        while pending or engine.has_unfinished():
            now = clock()
            while pending and start + pending[0][0] <= now:
                _, _, rid, req = heapq.heappop(pending)
                seq = engine.add_request(req.prompt_token_ids, sampling_params(req.output_len, structured), request_id=rid)
                live.append((req, seq, start + req.arrival_s))
                sent[rid] = (req, seq)
            if engine.has_unfinished():
                for out in engine.step():  # the requests the step advanced
                    if not out.finished:
                        continue
                    spec[out.request_id] = SpecCounts.of(out.metrics)
                    if on_finish is not None:
                        on_finish()
                    req, seq = sent[out.request_id]
                    if req.next_turns:
                        nxt = req.follow_up(seq.output_token_ids, clock() - start)
                        conv, _, turn = out.request_id.partition(".")
                        rid = f"{conv}.{int(turn or 0) + 1}"
                        heapq.heappush(pending, (nxt.arrival_s, next(order), rid, nxt))
            elif pending:
                sleep(max(0.0, start + pending[0][0] - clock()))
        end = clock()
    finally:
        for _, seq, _ in live:
            if not seq.finished:
                engine.abort(seq.request_id)
            engine.requests.pop(seq.request_id, None)
    records = [
        RequestRecord(len(req.prompt_token_ids), len(seq.output_token_ids), arrival, list(seq.token_times), seq.num_cached_tokens,
                      spec.get(seq.request_id, SpecCounts()))
        for req, seq, arrival in live
    ]
    metrics = compute_metrics(records, start, end)
    add_engine_counters(metrics, before, engine.stats())
    if structured is not None and structured.json is not None:
        schema = json.loads(structured.key[1])
        metrics.schema_failures, metrics.schema_failure = schema_failures([seq.text for _, seq, _ in live], schema)
    return metrics


def add_engine_counters(metrics: ServeMetrics, before: EngineStats, after: EngineStats) -> None:
    """The engine's counters over the run (``after - before``): preemptions, prefix-cache
    queries and hits, prefill and decode steps, the mean decode batch; speculation's counts
    where the requests' outputs gave none (over HTTP: a server's ``/metrics``)."""
    if not metrics.spec_num_drafts:
        spec = SpecCounts(after.spec_decode_num_drafts - before.spec_decode_num_drafts,
                          after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                          after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens)
        for name, value in spec.fields().items():
            setattr(metrics, name, value)
    metrics.num_preemptions = after.num_preemptions - before.num_preemptions
    metrics.prefix_cache_queries = after.prefix_cache_queries - before.prefix_cache_queries
    metrics.prefix_cache_hits = after.prefix_cache_hits - before.prefix_cache_hits
    if metrics.prefix_cache_queries:
        metrics.prefix_cache_hit_rate = metrics.prefix_cache_hits / metrics.prefix_cache_queries
    metrics.prefill_steps = after.prefill_steps - before.prefill_steps
    metrics.decode_steps = after.decode_steps - before.decode_steps
    if metrics.decode_steps:
        metrics.mean_decode_batch = (after.decode_rows - before.decode_rows) / metrics.decode_steps
