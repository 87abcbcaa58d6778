"""`ingot bench serve`'s metrics on hand-made token streams: percentiles, TTFT, ITL, TPOT,
throughput, and the median of repeated rounds."""

from __future__ import annotations

import random

import pytest

from ingot.bench.serve import (
    RequestRecord,
    compute_metrics,
    inter_token_latencies,
    median_round,
    percentile,
    round_summary,
    summarize,
    ttft,
)


def test_percentile_hand_computed():
    vals = [10, 1, 4, 2, 3]  # sorted: 1 2 3 4 10
    assert percentile(vals, 50) == 3
    assert percentile(vals, 90) == pytest.approx(7.6)  # rank 3.6: 4 + 0.6 * (10 - 4)
    assert percentile(vals, 99) == pytest.approx(9.76)  # rank 3.96
    assert percentile(vals, 0) == 1 and percentile(vals, 100) == 10
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    for n in (1, 2, 7, 100):
        vals = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 13, 50, 90, 99, 100):
            assert percentile(vals, q) == pytest.approx(float(np.percentile(vals, q)))


def test_ttft_and_itl_of_one_stream():
    times = [1.0, 1.5, 2.5, 2.75]
    assert ttft(0.25, times) == pytest.approx(0.75)
    assert inter_token_latencies(times) == pytest.approx([0.5, 1.0, 0.25])
    assert inter_token_latencies([3.0]) == []
    assert ttft(0.0, []) is None


def test_summarize_empty_and_scaled():
    assert summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    s = summarize([1.0, 3.0], scale=1e3)
    assert s["mean"] == pytest.approx(2000) and s["p50"] == pytest.approx(2000) and s["p90"] == pytest.approx(2800)


def test_compute_metrics_hand_computed():
    records = [
        RequestRecord(input_len=4, output_len=4, arrival=10.25, token_times=[11.0, 11.5, 12.5, 12.75]),
        RequestRecord(input_len=6, output_len=2, arrival=10.0, token_times=[10.5, 11.0]),
        RequestRecord(input_len=5, output_len=1, arrival=10.0, token_times=[12.0]),  # one token: no ITL
    ]
    m = compute_metrics(records, start=10.0, end=13.0)
    assert m.duration_s == pytest.approx(3.0)
    assert m.num_requests == 3 and m.input_tokens == 15 and m.output_tokens == 7
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(7 / 3)
    assert m.total_throughput == pytest.approx(22 / 3)
    # TTFTs 0.75, 0.5, 2.0 s -> sorted 0.5 0.75 2.0
    assert m.ttft_ms["mean"] == pytest.approx(3250 / 3)
    assert m.ttft_ms["p50"] == pytest.approx(750)
    assert m.ttft_ms["p90"] == pytest.approx(1750)  # rank 1.8: 0.75 + 0.8 * 1.25
    # ITLs 0.5 1.0 0.25 | 0.5 -> sorted 0.25 0.5 0.5 1.0
    assert m.itl_ms["mean"] == pytest.approx(562.5)
    assert m.itl_ms["p50"] == pytest.approx(500)
    assert m.itl_ms["p90"] == pytest.approx(850)  # rank 2.7
    assert m.itl_ms["p99"] == pytest.approx(985)  # rank 2.97
    # TPOTs (last - first token) / (tokens - 1): 1.75 / 3, 0.5 / 1; the one-token request has none
    assert m.tpot_ms["mean"] == pytest.approx((1750 / 3 + 500) / 2)
    assert m.tpot_ms["p50"] == pytest.approx((1750 / 3 + 500) / 2)
    assert [r["ttft_ms"] for r in m.requests] == pytest.approx([750, 500, 2000])
    assert [r["arrival_s"] for r in m.requests] == pytest.approx([0.25, 0.0, 0.0])
    assert [r["latency_s"] for r in m.requests] == pytest.approx([2.5, 1.0, 2.0])


def test_median_round_of_odd_even_and_tied_counts():
    def runs(*durations):
        return [compute_metrics([RequestRecord(1, 1, 0.0, [d])], 0.0, d) for d in durations]

    assert median_round(runs(3.0, 1.0, 2.0)) == 2
    assert median_round(runs(4.0, 1.0, 3.0, 2.0)) == 3, "even count: the shorter of the two middle runs (2.0 s)"
    assert median_round(runs(2.0, 2.0, 2.0)) == 1 and median_round(runs(5.0)) == 0
    with pytest.raises(ValueError):
        median_round([])


def test_round_summary_hand_computed():
    m = compute_metrics([RequestRecord(4, 3, 10.0, [10.5, 11.0, 12.0]), RequestRecord(2, 1, 10.0, [11.5])], 10.0, 12.5)
    m.prefix_cache_hit_rate = 0.25
    assert round_summary(m) == {"duration_s": 2.5, "output_throughput": 4 / 2.5, "ttft_p50_ms": 1000.0,
                                "itl_p50_ms": 750.0, "tpot_p50_ms": 750.0, "output_tokens": 4, "prefix_cache_hit_rate": 0.25}
