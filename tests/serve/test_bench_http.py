"""`ingot bench serve --url` against a running `ingot serve`: every request of the workload
completes with the lengths it asked for, and the latency numbers are consistent."""

from __future__ import annotations

import json

import pytest

import ingot

from ingot.bench.http_serve import parse_engine_stats
from ingot.bench.serve import RequestRecord
from ingot.cli import main
from tests.helpers import write_tiny_checkpoint
from tests.serve.server_process import running_server


def test_tpot_is_the_mean_gap_after_the_first_token():
    rec = RequestRecord(input_len=3, output_len=4, arrival=10.0, token_times=[10.5, 10.7, 10.8, 11.1])
    assert rec.tpot == pytest.approx((1.1 - 0.5) / 3)
    assert RequestRecord(3, 1, 10.0, [10.5]).tpot is None


def test_engine_counters_read_back_from_the_metrics_text():
    """What ``/metrics`` renders (prometheus_client's text) parses back into the engine's
    counters; another server's metrics give None."""
    from ingot.engine.stats import EngineStats
    from ingot.serve.metrics import ServerMetrics

    stats = EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.5, num_preemptions=4, prompt_tokens=1234,
                        generation_tokens=567, prefix_cache_queries=900, prefix_cache_hits=320, prefill_steps=17,
                        decode_steps=211, decode_rows=9876)
    got = parse_engine_stats(ServerMetrics(lambda: stats, "m").render().decode())
    counters = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}  # gauges are not counters over a run
    assert got == EngineStats(**{**stats.__dict__, **counters})
    assert parse_engine_stats("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3.0\n") is None


@pytest.mark.parametrize("where, clients", [("process", 1), ("thread", 2)])
def test_bench_serve_over_http(tmp_path, capsys, where, clients):
    """Every request counted once, also when two client processes share the workload (each
    with half the concurrency: the engine's batch never exceeds 8)."""
    path = write_tiny_checkpoint(tmp_path / "llama", "llama")
    extra = ["--engine-in-thread"] if where == "thread" else []
    with running_server("--model", str(path), "--dtype", "float32", "--api-key", "k", "--quiet", *extra) as srv:
        out = tmp_path / "http.json"
        rc = main(["bench", "serve", "--url", srv.url, "--api-key", "k", "--num-requests", "24", "--input-len", "4-40",
                   "--output-len", "3-9", "--max-concurrency", "8", "--vocab-size", "300", "--json", str(out), "--quiet",
                   "--client-processes", str(clients)])
        assert rc == 0
        data = json.loads(out.read_text())
    (result,) = data["results"]
    assert result["failed"] == 0 and result["num_requests"] == 24
    assert data["environment"]["client_processes"] == clients
    from ingot.bench.workload import Workload, make_requests

    reqs = make_requests(Workload(24, (4, 40), (3, 9)), 300)
    assert result["output_tokens"] == sum(r.output_len for r in reqs)
    assert result["input_tokens"] == sum(len(r.prompt_token_ids) for r in reqs)
    # the server's engine counters over the run, read from /metrics: every request prefilled,
    # every token after a request's first came from a decode step's row
    assert result["prefill_steps"] >= 1 and result["decode_steps"] >= 1
    rows = result["mean_decode_batch"] * result["decode_steps"]
    assert result["output_tokens"] - 24 <= round(rows) and 1 <= result["mean_decode_batch"] <= 8
    assert result["prefix_cache_queries"] == result["input_tokens"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        stats = result[key]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
    table = capsys.readouterr().out
    assert "TPOT p99" in table and "output tokens/s" in table
    # the header says only what the server told (/v1/models, /version): no placeholders
    assert f"max_model_len 256, server version {ingot.__version__}) at {srv.url}" in table
    assert " - " not in table.splitlines()[1] and "compile http" not in table and "server" in table
