"""Serving benchmark: end-to-end throughput and latency on a synthetic workload.

The workload is ``num_requests`` requests whose prompt and output lengths are
drawn uniformly from inclusive ranges, with random prompt token ids, all from
one seed. Requests arrive all at once (``request_rate=inf``) or as a Poisson
process of the given rate (requests/s). The driver adds each request to the
engine once its arrival time has passed and steps the engine in between.

Prefix sharing: with ``shared_prefix_len`` N every prompt starts with the same
N random tokens (a system prompt), then its own part drawn from ``input_len``.
``kind="multi-turn"``: each of the ``num_requests`` is a conversation of
``turns`` turns; a turn's prompt is the conversation so far (the previous
prompt, the tokens the model answered, a new user message of ``input_len``
tokens), sent as soon as the previous turn has finished. The engine's prefix
cache hit rate over the run is reported (cached prompt tokens / prompt tokens).

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
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

from ingot.engine.stats import EngineStats
from ingot.sampling_params import SamplingParams, StructuredOutputsParams

# Prompt token ids are drawn from [SPECIAL_MARGIN, vocab_size - SPECIAL_MARGIN):
# special tokens (bos, eos, pad, chat markers) usually sit at either end of the vocab.
SPECIAL_MARGIN = 10
PERCENTILES = (50, 90, 99)
KINDS = ("random", "multi-turn")


class WorkloadError(ValueError):
    """The workload is invalid or does not fit the model (the message says which bound)."""


# ---------------------------------------------------------------- workload
@dataclass(frozen=True)
class Workload:
    """What to send: counts, inclusive length ranges, arrival rate and seed."""

    num_requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    request_rate: float = math.inf  # requests/s; inf = all at once
    seed: int = 0
    shared_prefix_len: int = 0  # tokens every prompt starts with
    kind: str = "random"  # or "multi-turn": num_requests conversations
    turns: tuple[int, int] = (1, 1)  # turns per conversation (multi-turn)

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise WorkloadError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.shared_prefix_len < 0:
            raise WorkloadError(f"shared_prefix_len must be >= 0, got {self.shared_prefix_len}")
        if self.kind not in KINDS:
            raise WorkloadError(f"workload must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "random" and self.turns != (1, 1):
            raise WorkloadError("turns apply to the multi-turn workload only")
        for name in ("input_len", "output_len", "turns"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise WorkloadError(f"{name} range must satisfy 1 <= low <= high, got {lo}-{hi}")
        if not self.request_rate > 0:  # also rejects NaN
            raise WorkloadError(f"request_rate must be > 0 (or inf), got {self.request_rate}")

    def to_json(self) -> dict:
        d = asdict(self)
        d["input_len"], d["output_len"], d["turns"] = list(self.input_len), list(self.output_len), list(self.turns)
        d["request_rate"] = format_rate(self.request_rate)
        return d


@dataclass(frozen=True)
class Turn:
    """A later turn of a conversation: the user's new message and the reply length."""

    user_token_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    output_len: int
    arrival_s: float  # seconds after the start of the run
    next_turns: tuple[Turn, ...] = ()  # sent one by one, each once the previous turn has finished

    @property
    def max_len(self) -> int:
        """Tokens the last turn can reach: every prompt, reply and later message."""
        return len(self.prompt_token_ids) + self.output_len + sum(len(t.user_token_ids) + t.output_len for t in self.next_turns)

    def follow_up(self, output_token_ids: list[int], arrival_s: float) -> "Request":
        """The next turn: this prompt, the reply the model gave, the next user message."""
        turn, *rest = self.next_turns
        return Request(self.prompt_token_ids + list(output_token_ids) + turn.user_token_ids, turn.output_len, arrival_s, tuple(rest))


def parse_range(text: str) -> tuple[int, int]:
    """``"64-1024"`` -> (64, 1024); ``"32"`` -> (32, 32). Bounds are inclusive."""
    parts = text.strip().split("-")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"expected a length or a range LOW-HIGH, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"range must satisfy 1 <= LOW <= HIGH, got {text!r}")
    return lo, hi


def parse_rate(text: str) -> float:
    """Requests per second; ``inf`` (default) sends every request at once."""
    rate = float(text)
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 or inf, got {text!r}")
    return rate


def format_rate(rate: float) -> object:
    return "inf" if math.isinf(rate) else rate


def make_requests(workload: Workload, vocab_size: int) -> list[Request]:
    """The workload's requests, in arrival order; the same seed gives the same requests.

    Lengths and prompts come from one random stream, the shared prefix and arrival
    gaps from others, so changing the rate or the prefix keeps the rest. The first
    request arrives at 0. Multi-turn: one request per conversation, its later turns
    in ``next_turns``.
    """
    lo_id, hi_id = SPECIAL_MARGIN, vocab_size - SPECIAL_MARGIN
    if hi_id <= lo_id:
        raise WorkloadError(f"vocab of {vocab_size} tokens is too small for random prompts")
    rng = random.Random(workload.seed)
    arrivals_rng = random.Random(f"arrivals-{workload.seed}")
    prefix_rng = random.Random(f"prefix-{workload.seed}")
    prefix = [prefix_rng.randrange(lo_id, hi_id) for _ in range(workload.shared_prefix_len)]
    out: list[Request] = []
    t = 0.0
    for i in range(workload.num_requests):
        turns = []
        # a single-turn workload draws no turn count: its requests (lengths, ids) match those of
        # the same seed drawn without any turns field, as in earlier result files
        for _ in range(rng.randint(*workload.turns) if workload.kind == "multi-turn" else 1):
            in_len = rng.randint(*workload.input_len)
            out_len = rng.randint(*workload.output_len)
            turns.append(Turn([rng.randrange(lo_id, hi_id) for _ in range(in_len)], out_len))
        if i > 0 and not math.isinf(workload.request_rate):
            t += arrivals_rng.expovariate(workload.request_rate)
        first, *later = turns
        out.append(Request(prefix + first.user_token_ids, first.output_len, t, tuple(later)))
    return out


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


@dataclass
class RequestRecord:
    """One finished request: lengths and absolute (monotonic) times."""

    input_len: int
    output_len: int  # tokens produced
    arrival: float
    token_times: list[float]
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

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
    )


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


def check_fits(requests: Sequence[Request], max_model_len: int) -> None:
    """Every request (every turn of a conversation) must fit its prompt and output in the context."""
    worst = max(r.max_len for r in requests)
    if worst > max_model_len:
        raise WorkloadError(
            f"a request needs {worst} tokens (prompt + output) but max_model_len is {max_model_len}; "
            "lower --input-len/--output-len or raise --max-model-len"
        )


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
        RequestRecord(len(req.prompt_token_ids), len(seq.output_token_ids), arrival, list(seq.token_times), seq.num_cached_tokens)
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
    queries and hits, prefill and decode steps, the mean decode batch."""
    metrics.num_preemptions = after.num_preemptions - before.num_preemptions
    metrics.prefix_cache_queries = after.prefix_cache_queries - before.prefix_cache_queries
    metrics.prefix_cache_hits = after.prefix_cache_hits - before.prefix_cache_hits
    if metrics.prefix_cache_queries:
        metrics.prefix_cache_hit_rate = metrics.prefix_cache_hits / metrics.prefix_cache_queries
    metrics.prefill_steps = after.prefill_steps - before.prefill_steps
    metrics.decode_steps = after.decode_steps - before.decode_steps
    if metrics.decode_steps:
        metrics.mean_decode_batch = (after.decode_rows - before.decode_rows) / metrics.decode_steps
