"""Prometheus metrics of the server, named ``ingot:*`` (``GET /metrics``).

Engine state (running and waiting requests, KV-cache usage, preemptions,
prompt and generation tokens, prefix-cache queries and hits, prefill and
decode steps and the decode batches' rows, speculative drafts, drafted and accepted
tokens) is read from the
engine's stats when Prometheus scrapes; latencies are observed per request
when it finishes, from its RequestMetrics: time to first token, inter-token
latency (each gap between two of its tokens counts once, at the request's mean
gap) and end-to-end latency.

With several API servers (``--api-server-count``) every one of them reads the
same engine stats (the engine sends them to each), and the latency histograms
are prometheus_client's multiprocess ones: each process writes its own file in
``multiprocess_dir`` (``PROMETHEUS_MULTIPROC_DIR``, set before the process
imported prometheus_client) and ``/metrics`` in any of them sums all files.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ingot.engine.stats import EngineStats
from ingot.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], model: str) -> None:
        self.stats = stats
        self.model = model

    def collect(self) -> Iterator:
        s = self.stats()
        label = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=label)
            g.add_metric([self.model], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=label)
            c.add_metric([self.model], value)
            return c

        yield gauge("ingot:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("ingot:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("ingot:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", s.kv_cache_usage)
        yield counter("ingot:num_preemptions", "Sequences preempted for lack of KV cache.", s.num_preemptions)
        yield counter("ingot:prompt_tokens", "Prompt tokens of the requests admitted.", s.prompt_tokens)
        yield counter("ingot:generation_tokens", "Tokens generated.", s.generation_tokens)
        yield counter("ingot:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield counter("ingot:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("ingot:prefill_steps", "Engine steps that computed prompt tokens.", s.prefill_steps)
        yield counter("ingot:decode_steps", "Engine steps that decoded one token per running sequence.", s.decode_steps)
        yield counter("ingot:decode_rows", "Sequences in the decode steps, summed (mean decode batch: over decode_steps).",
                      s.decode_rows)
        yield counter("ingot:spec_decode_num_drafts", "Speculative drafts verified.", s.spec_decode_num_drafts)
        yield counter("ingot:spec_decode_num_draft_tokens", "Speculative tokens drafted.", s.spec_decode_num_draft_tokens)
        yield counter("ingot:spec_decode_num_accepted_tokens", "Speculative drafted tokens accepted.",
                      s.spec_decode_num_accepted_tokens)


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats], model: str, multiprocess_dir: Optional[str] = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, model))
        # several processes: the histograms live in files, read back by the collector (registering
        # them here as well would report this process's share twice)
        own = self.registry if multiprocess_dir is None else None
        if multiprocess_dir is not None:
            MultiProcessCollector(self.registry, multiprocess_dir)
        self.model = model
        label = ["model_name"]
        self.ttft = Histogram("ingot:time_to_first_token_seconds", "Time to first token.", label,
                              buckets=_TTFT_BUCKETS, registry=own).labels(model)
        self.itl = Histogram("ingot:inter_token_latency_seconds", "Time between two output tokens.", label,
                             buckets=_ITL_BUCKETS, registry=own).labels(model)
        self.e2e = Histogram("ingot:e2e_request_latency_seconds", "Arrival to finish, per request.", label,
                             buckets=_E2E_BUCKETS, registry=own).labels(model)

    def observe(self, out: RequestOutput) -> None:
        """One finished request's latencies."""
        m = out.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.finished_time is not None:
            self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))
        tokens = max((len(c.token_ids) for c in out.outputs), default=0)
        if tokens > 1 and m.first_token_time is not None and m.last_token_time is not None:
            gap = max(0.0, (m.last_token_time - m.first_token_time) / (tokens - 1))
            for _ in range(tokens - 1):
                self.itl.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
