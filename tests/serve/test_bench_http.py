"""`ingot bench serve --url` against a running `ingot serve`: every request of the workload
completes with the lengths it asked for, and the latency numbers are consistent."""

from __future__ import annotations

import json

import pytest

from ingot.bench.http_serve import tpot
from ingot.bench.serve import RequestRecord
from ingot.cli import main
from tests.helpers import write_tiny_checkpoint
from tests.serve.server_process import running_server


def test_tpot_is_the_mean_gap_after_the_first_token():
    rec = RequestRecord(input_len=3, output_len=4, arrival=10.0, token_times=[10.5, 10.7, 10.8, 11.1])
    assert tpot(rec) == pytest.approx((1.1 - 0.5) / 3)
    assert tpot(RequestRecord(3, 1, 10.0, [10.5])) is None


@pytest.mark.parametrize("where", ["process", "thread"])
def test_bench_serve_over_http(tmp_path, capsys, where):
    path = write_tiny_checkpoint(tmp_path / "llama", "llama")
    extra = ["--engine-in-thread"] if where == "thread" else []
    with running_server("--model", str(path), "--dtype", "float32", "--api-key", "k", "--quiet", *extra) as srv:
        out = tmp_path / "http.json"
        rc = main(["bench", "serve", "--url", srv.url, "--api-key", "k", "--num-requests", "24", "--input-len", "4-40",
                   "--output-len", "3-9", "--max-concurrency", "8", "--vocab-size", "300", "--json", str(out), "--quiet"])
        assert rc == 0
        data = json.loads(out.read_text())
    (result,) = data["results"]
    assert result["failed"] == 0 and result["num_requests"] == 24
    from ingot.bench.serve import Workload, make_requests

    reqs = make_requests(Workload(24, (4, 40), (3, 9)), 300)
    assert result["output_tokens"] == sum(r.output_len for r in reqs)
    assert result["input_tokens"] == sum(len(r.prompt_token_ids) for r in reqs)
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        stats = result[key]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
    table = capsys.readouterr().out
    assert "TPOT p99" in table and "output tokens/s" in table
