"""`ingot bench serve`: metrics on hand-made token streams, the workload, the driver, and the CLI end to end."""

from __future__ import annotations

import gc

import json
import math
import random

import pytest

from ingot.bench.serve import (
    RequestRecord,
    compute_metrics,
    inter_token_latencies,
    median_round,
    percentile,
    round_summary,
    run_workload,
    summarize,
    ttft,
)
from ingot.bench.workload import Workload, WorkloadError, make_requests, parse_range, parse_rate
from ingot.cli import main
from ingot.engine.stats import EngineStats
from tests.helpers import TINY, write_tiny_checkpoint


# ---------------------------------------------------------------- metrics
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


# ---------------------------------------------------------------- workload
def test_parse_range_and_rate():
    assert parse_range("64-1024") == (64, 1024)
    assert parse_range("32") == (32, 32)
    for bad in ("0-4", "9-3", "a-b", "1-2-3", ""):
        with pytest.raises(ValueError):
            parse_range(bad)
    assert math.isinf(parse_rate("inf")) and parse_rate("2.5") == 2.5
    for bad in ("0", "-1", "nan"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_workload_deterministic_and_in_range():
    w = Workload(50, (3, 9), (2, 5), seed=7)
    a, b = make_requests(w, 384), make_requests(w, 384)
    assert a == b
    assert make_requests(Workload(50, (3, 9), (2, 5), seed=8), 384) != a
    assert all(3 <= len(r.prompt_token_ids) <= 9 and 2 <= r.output_len <= 5 for r in a)
    assert all(10 <= t < 384 - 10 for r in a for t in r.prompt_token_ids)
    assert {len(r.prompt_token_ids) for r in a} == set(range(3, 10))  # uniform: every length shows up
    assert all(r.arrival_s == 0.0 for r in a)


def test_poisson_arrivals():
    inf = make_requests(Workload(2000, (1, 4), (1, 4), seed=1), 100)
    timed = make_requests(Workload(2000, (1, 4), (1, 4), request_rate=10.0, seed=1), 100)
    assert [(r.prompt_token_ids, r.output_len) for r in timed] == [(r.prompt_token_ids, r.output_len) for r in inf]
    arrivals = [r.arrival_s for r in timed]
    assert arrivals[0] == 0.0 and all(x < y for x, y in zip(arrivals, arrivals[1:]))
    assert arrivals[-1] / (len(arrivals) - 1) == pytest.approx(0.1, rel=0.1)  # mean gap 1/rate
    assert make_requests(Workload(2000, (1, 4), (1, 4), request_rate=10.0, seed=1), 100) == timed


def test_workload_validation():
    with pytest.raises(WorkloadError):
        Workload(0, (1, 2), (1, 2))
    with pytest.raises(WorkloadError):
        Workload(1, (3, 2), (1, 2))
    with pytest.raises(WorkloadError):
        Workload(1, (1, 2), (1, 2), request_rate=0.0)
    with pytest.raises(WorkloadError):
        make_requests(Workload(1, (1, 2), (1, 2)), vocab_size=20)


# ---------------------------------------------------------------- driver on a fake engine and clock
class _FakeSeq:
    def __init__(self, rid, n):
        self.request_id, self.n = rid, n
        self.output_token_ids, self.token_times = [], []
        self.num_cached_tokens = 0
        self.metrics = None  # (it stands for its own RequestOutput too: no speculation counts)

    @property
    def finished(self):
        return len(self.output_token_ids) >= self.n


class _FakeEngine:
    """Every step takes 0.25 s of fake time and gives every live sequence one token."""

    max_model_len = 1000

    def __init__(self, clock):
        self.clock = clock
        self.requests = {}
        self.stats = EngineStats
        self.added_at = {}

    def add_request(self, prompt, params, request_id):
        seq = _FakeSeq(request_id, params.max_tokens)
        self.requests[request_id] = seq
        self.added_at[request_id] = self.clock.t
        return seq

    def has_unfinished(self):
        return any(not s.finished for s in self.requests.values())

    def step(self):
        self.clock.t += 0.25
        live = [s for s in self.requests.values() if not s.finished]
        for s in live:
            s.output_token_ids.append(0)
            s.token_times.append(self.clock.t)
        return live

    def abort(self, rid):
        pass


class _Clock:
    def __init__(self):
        self.t = 64.0  # fake times are binary fractions: exact sums
        self.slept = []

    def __call__(self):
        return self.t

    def sleep(self, dt):
        self.slept.append(dt)
        self.t += dt


def test_driver_adds_requests_at_their_arrival_times():
    from ingot.bench.workload import Request

    reqs = [Request([11], 3, 0.0), Request([12], 2, 0.125), Request([13], 2, 2.0)]
    clock = _Clock()
    eng = _FakeEngine(clock)
    m = run_workload(eng, reqs, clock=clock, sleep=clock.sleep)
    # r0 added at once; r1 (due at +0.125) waits for the step in flight (added at +0.25); r2 after an idle sleep
    assert eng.added_at == {"serve-0": 64.0, "serve-1": 64.25, "serve-2": 66.0}
    assert clock.slept == [1.25]  # r0 and r1 both end at +0.75: idle until +2.0
    assert m.output_tokens == 7 and m.duration_s == 2.5
    # TTFT counts from the scheduled arrival: r1 was due at +0.125, first token at +0.5
    assert [r["ttft_ms"] for r in m.requests] == pytest.approx([250, 375, 250])
    assert eng.requests == {}  # the driver cleans up after itself


# ---------------------------------------------------------------- CLI end to end on a tiny checkpoint
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("serve") / "llama", "llama")


def _serve(tiny, tmp_path, *extra):
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--model", str(tiny), "--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
            "--input-len", "8-32", "--output-len", "8-32", "--seed", "5", "--quiet", "--json", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def _check_consistent(doc, workload, vocab_size=TINY["vocab_size"]):
    drawn = make_requests(workload, vocab_size)
    for r in doc["results"]:
        assert r["num_requests"] == workload.num_requests
        assert r["output_tokens"] == sum(q.output_len for q in drawn)
        assert r["input_tokens"] == sum(len(q.prompt_token_ids) for q in drawn)
        assert [q["output_len"] for q in r["requests"]] == [q.output_len for q in drawn]
        dur = r["duration_s"]
        assert dur > 0
        assert all(0 < q["ttft_ms"] <= dur * 1e3 for q in r["requests"])
        assert all(q["latency_s"] <= dur for q in r["requests"])
        assert r["request_throughput"] == pytest.approx(workload.num_requests / dur, rel=1e-6)
        assert r["output_throughput"] == pytest.approx(r["output_tokens"] / dur, rel=1e-6)
        assert r["total_throughput"] == pytest.approx((r["input_tokens"] + r["output_tokens"]) / dur, rel=1e-6)
        for key in ("ttft_ms", "itl_ms"):
            s = r[key]
            assert 0 < s["p50"] <= s["p90"] <= s["p99"]
        assert r["ttft_ms"]["p99"] <= dur * 1e3


def test_cli_all_at_once_both_modes(tiny, tmp_path, capsys):
    doc = _serve(tiny, tmp_path, "--num-requests", "6", "--compile-modes", "off,on")
    assert [r["mode"] for r in doc["results"]] == ["off", "on"]
    assert doc["workload"] == {"num_requests": 6, "input_len": [8, 32], "output_len": [8, 32], "request_rate": "inf", "seed": 5,
                               "shared_prefix_len": 0, "kind": "random", "turns": [1, 1]}
    env = doc["environment"]
    assert env["device"] == "cpu" and env["torch"] and env["date"] and env["max_model_len"] == 256
    _check_consistent(doc, Workload(6, (8, 32), (8, 32), seed=5))
    assert env["prefix_caching"] is True and env["overlap_scheduling"] is True
    assert all("rounds" not in r for r in doc["results"])
    out = capsys.readouterr().out
    assert "TTFT p99 (ms)" in out and "output tokens/s" in out and "compile on" in out and "rounds" not in out


def test_cli_poisson_rate_finishes_all(tiny, tmp_path):
    doc = _serve(tiny, tmp_path, "--num-requests", "8", "--request-rate", "40")
    assert doc["workload"]["request_rate"] == 40.0
    (r,) = doc["results"]
    _check_consistent(doc, Workload(8, (8, 32), (8, 32), request_rate=40.0, seed=5))
    arrivals = [q["arrival_s"] for q in r["requests"]]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert r["duration_s"] >= arrivals[-1]


def test_cli_workload_too_long_for_context(tiny, tmp_path, capsys):
    argv = ["bench", "serve", "--model", str(tiny), "--device", "cpu", "--max-model-len", "64",
            "--input-len", "40-60", "--output-len", "8-32", "--num-requests", "4", "--quiet"]
    assert main(argv) == 2
    assert "max_model_len is 64" in capsys.readouterr().err


def test_cli_compile_modes_parsing(capsys):
    from ingot.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["bench", "serve"]).compile_modes == ["off"]
    assert parse(["bench", "serve", "--compile-modes", "off,on"]).compile_modes == ["off", "on"]
    assert parse(["bench", "serve", "--decode-compile", "auto, off,auto"]).compile_modes == ["auto", "off"]
    assert parse(["bench", "serve", "--decode-compile"]).compile_modes == ["on"]
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--compile-modes", "off,maybe"])
    assert "off/on/auto" in capsys.readouterr().err


def test_cli_random_weight_shape(tmp_path, monkeypatch):
    """--shape serves a random model of a benchmark shape: no checkpoint, every token accounted for."""
    from ingot.loading import dummy

    fields = dict(architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=320, max_position_embeddings=512,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
    monkeypatch.setitem(dummy.SHAPES, "tiny-shape-test", fields)
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--shape", "tiny-shape-test", "--device", "cpu", "--dtype", "float32",
            "--max-model-len", "128", "--input-len", "4-20", "--output-len", "3-9", "--num-requests", "5",
            "--seed", "2", "--quiet", "--json", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["environment"]["model"] == "random weights, tiny-shape-test"
    assert doc["environment"]["architecture"] == "Qwen2ForCausalLM" and doc["environment"]["max_model_len"] == 128
    _check_consistent(doc, Workload(5, (4, 20), (3, 9), seed=2), vocab_size=320)


def test_id_tokenizer_round_trip():
    from ingot.loading.dummy import id_tokenizer

    tok = id_tokenizer(50)
    assert tok.decode([3, 49, 0]) == "<3> <49> <0>"
    assert tok.encode("<3> <49>", add_special_tokens=False) == [3, 49]
    assert tok.vocab_size == 50 and tok.eos_token_ids == ()


# ---------------------------------------------------------------- shared prefixes, multi-turn, prefix-cache hit rate
def test_shared_prefix_workload():
    plain = make_requests(Workload(20, (3, 9), (2, 5), seed=4), 384)
    shared = make_requests(Workload(20, (3, 9), (2, 5), seed=4, shared_prefix_len=12), 384)
    prefix = shared[0].prompt_token_ids[:12]
    assert len(prefix) == 12 and all(10 <= t < 374 for t in prefix)
    for p, s in zip(plain, shared):
        assert s.prompt_token_ids == prefix + p.prompt_token_ids, "prefix, then the same suffix as without one"
        assert s.output_len == p.output_len and s.next_turns == ()
    assert make_requests(Workload(20, (3, 9), (2, 5), seed=5, shared_prefix_len=12), 384)[0].prompt_token_ids[:12] != prefix
    with pytest.raises(WorkloadError):
        Workload(1, (1, 2), (1, 2), shared_prefix_len=-1)


def test_multi_turn_workload():
    w = Workload(30, (3, 9), (2, 5), seed=1, shared_prefix_len=4, kind="multi-turn", turns=(2, 4))
    convs = make_requests(w, 384)
    assert len(convs) == 30 and make_requests(w, 384) == convs
    assert {1 + len(c.next_turns) for c in convs} == {2, 3, 4}
    prefix = convs[0].prompt_token_ids[:4]
    for c in convs:
        assert c.prompt_token_ids[:4] == prefix and 3 <= len(c.prompt_token_ids) - 4 <= 9
        assert all(3 <= len(t.user_token_ids) <= 9 and 2 <= t.output_len <= 5 for t in c.next_turns)
        assert c.max_len == len(c.prompt_token_ids) + c.output_len + sum(len(t.user_token_ids) + t.output_len for t in c.next_turns)
    c = convs[0]
    nxt = c.follow_up([100, 101], 2.5)
    assert nxt.prompt_token_ids == c.prompt_token_ids + [100, 101] + c.next_turns[0].user_token_ids
    assert nxt.output_len == c.next_turns[0].output_len and nxt.arrival_s == 2.5 and nxt.next_turns == c.next_turns[1:]
    with pytest.raises(WorkloadError):
        Workload(1, (1, 2), (1, 2), turns=(2, 3))  # turns need the multi-turn workload
    with pytest.raises(WorkloadError):
        Workload(1, (1, 2), (1, 2), kind="chat")


def test_driver_sends_each_turn_after_the_previous_one_finished():
    from ingot.bench.workload import Request, Turn

    reqs = [Request([11], 2, 0.0, (Turn([12, 13], 1), Turn([14], 2))), Request([15], 3, 0.0)]
    clock = _Clock()
    eng = _FakeEngine(clock)
    prompts = {}
    add = eng.add_request

    def recording(prompt, params, request_id):
        prompts[request_id] = list(prompt)
        return add(prompt, params, request_id)

    eng.add_request = recording
    m = run_workload(eng, reqs, clock=clock, sleep=clock.sleep)
    # conversation 0: turn 0 ends at +0.5, turn 1 (one token) at +0.75, turn 2 at +1.25; request 1 ends at +0.75
    assert eng.added_at == {"serve-0": 64.0, "serve-1": 64.0, "serve-0.1": 64.5, "serve-0.2": 64.75}
    assert prompts["serve-0.1"] == [11, 0, 0, 12, 13] and prompts["serve-0.2"] == [11, 0, 0, 12, 13, 0, 14]
    assert m.num_requests == 4 and m.output_tokens == 8 and m.duration_s == 1.25
    assert [r["input_len"] for r in m.requests] == [1, 1, 5, 7]
    assert [r["ttft_ms"] for r in m.requests] == pytest.approx([250, 250, 250, 250]), "a turn's TTFT counts from when it was sent"
    assert eng.requests == {}


def test_check_fits_counts_every_turn():
    from ingot.bench.workload import Request, Turn, check_fits

    conv = Request([1] * 10, 5, 0.0, (Turn([2] * 10, 5),))
    check_fits([conv], 30)
    with pytest.raises(WorkloadError, match="30 tokens"):
        check_fits([conv], 29)


def test_cli_shared_prefix_caching_on_and_off(tiny, tmp_path, capsys):
    doc = _serve(tiny, tmp_path, "--num-requests", "6", "--shared-prefix-len", "40", "--max-num-seqs", "2")
    assert doc["workload"]["shared_prefix_len"] == 40 and doc["environment"]["prefix_caching"] is True
    (on,) = doc["results"]
    _check_consistent(doc, Workload(6, (8, 32), (8, 32), seed=5, shared_prefix_len=40))
    out = capsys.readouterr().out
    doc = _serve(tiny, tmp_path, "--num-requests", "6", "--shared-prefix-len", "40", "--max-num-seqs", "2",
                 "--no-prefix-caching")
    assert doc["environment"]["prefix_caching"] is False
    (off,) = doc["results"]
    # two run at a time: the first two compute the prefix, the other four reuse its 2 full blocks of 16
    assert on["prefix_cache_queries"] == on["input_tokens"] and on["prefix_cache_hits"] == 4 * 32
    assert on["prefix_cache_hit_rate"] == pytest.approx(128 / on["input_tokens"])
    assert sorted(q["cached_tokens"] for q in on["requests"]) == [0, 0, 32, 32, 32, 32]
    assert off["prefix_cache_hit_rate"] is None and off["prefix_cache_queries"] == 0
    assert all(q["cached_tokens"] == 0 for q in off["requests"])
    assert "prefix cache hit rate" in out and f"{on['prefix_cache_hit_rate']:.1%}" in out and "shared 40-token prefix" in out


def test_cli_no_prefix_caching_flag():
    from ingot.cli import build_parser

    parse = build_parser().parse_args
    assert not parse(["bench", "serve"]).no_prefix_caching
    assert parse(["bench", "serve", "--no-prefix-caching"]).no_prefix_caching
    assert parse(["generate", "hi", "--no-prefix-caching"]).no_prefix_caching


def test_cli_multi_turn(tiny, tmp_path):
    doc = _serve(tiny, tmp_path, "--num-requests", "3", "--workload", "multi-turn", "--turns", "2-3",
                 "--shared-prefix-len", "16")
    w = Workload(3, (8, 32), (8, 32), seed=5, shared_prefix_len=16, kind="multi-turn", turns=(2, 3))
    convs = make_requests(w, TINY["vocab_size"])
    (r,) = doc["results"]
    assert doc["workload"]["kind"] == "multi-turn" and doc["workload"]["turns"] == [2, 3]
    assert r["num_requests"] == sum(1 + len(c.next_turns) for c in convs)
    assert r["output_tokens"] == sum(c.output_len + sum(t.output_len for t in c.next_turns) for c in convs)
    # a later turn resends the previous turn's prompt and reply: its full blocks are cached
    later = [q for q in r["requests"] if q["input_len"] > 16 + 32]
    assert later and all(q["cached_tokens"] >= 16 for q in later)
    assert r["prefix_cache_hit_rate"] > 0.3


def test_cli_turns_need_multi_turn(tiny, capsys):
    argv = ["bench", "serve", "--model", str(tiny), "--device", "cpu", "--turns", "2-3", "--quiet"]
    assert main(argv) == 2
    assert "multi-turn" in capsys.readouterr().err


def test_cli_multi_turn_needs_a_local_engine(capsys):
    argv = ["bench", "serve", "--url", "http://127.0.0.1:9", "--workload", "multi-turn", "--quiet"]
    assert main(argv) == 2
    assert "local engine" in capsys.readouterr().err


def test_step_counts_of_a_run(tiny, tmp_path):
    """Four 8-token prompts arriving together, 6 tokens each: one prefill step (it samples
    each first token), then 5 decode steps of all four."""
    doc = _serve(tiny, tmp_path, "--num-requests", "4", "--input-len", "8-8", "--output-len", "6-6")
    (r,) = doc["results"]
    assert (r["prefill_steps"], r["decode_steps"], r["mean_decode_batch"]) == (1, 5, 4.0)


# ---------------------------------------------------------------- --repeat: rounds on one engine
@pytest.fixture
def engine_calls(monkeypatch):
    """Record engine builds and the prefix-cache resets made on them."""
    from ingot.bench import serve_cli
    from ingot.engine.engine import Engine

    calls: list = []
    build, reset = serve_cli.build_engine, Engine.reset_prefix_cache

    def building(args, decode_compile):
        calls.append(("build", decode_compile))
        return build(args, decode_compile)

    def resetting(self):
        done = reset(self)
        calls.append(("reset", done))
        return done

    monkeypatch.setattr(serve_cli, "build_engine", building)
    monkeypatch.setattr(Engine, "reset_prefix_cache", resetting)
    return calls


def test_cli_repeat_runs_every_round_on_one_engine(tiny, tmp_path, capsys, monkeypatch, engine_calls):
    monkeypatch.setenv("COLUMNS", "240")  # the table unwrapped
    doc = _serve(tiny, tmp_path, "--num-requests", "5", "--no-overlap-scheduling", "--repeat", "3")
    assert engine_calls == [("build", False)] + [("reset", True)] * 3, "one engine, emptied before every round"
    assert doc["environment"]["overlap_scheduling"] is False
    _check_consistent(doc, Workload(5, (8, 32), (8, 32), seed=5))
    drawn = make_requests(Workload(5, (8, 32), (8, 32), seed=5), TINY["vocab_size"])
    (r,) = doc["results"]
    rounds = r["rounds"]
    assert len(rounds) == 3
    assert [x["output_tokens"] for x in rounds] == [sum(q.output_len for q in drawn)] * 3
    # no shared prefix: every round misses, the second as much as the first (the cache was emptied)
    assert [x["prefix_cache_hit_rate"] for x in rounds] == [0.0] * 3
    durations = [x["duration_s"] for x in rounds]
    k = r["median_round"]
    assert sorted(durations)[1] == durations[k] == r["duration_s"], "the result is the median round"
    assert rounds[k]["output_throughput"] == r["output_throughput"]
    assert rounds[k]["ttft_p50_ms"] == r["ttft_ms"]["p50"] and rounds[k]["itl_p50_ms"] == r["itl_ms"]["p50"]
    out = capsys.readouterr().out
    assert gc.get_freeze_count() == 0, "the runs froze the heap; dropping the engine must give it back"
    assert f"3 ({rounds[0]['duration_s']:.2f} / {rounds[1]['duration_s']:.2f} / {rounds[2]['duration_s']:.2f} s)" in out
    assert "warmup_rounds" not in r


def test_cli_warmup_rounds_run_first_and_are_not_counted(tiny, tmp_path, engine_calls):
    doc = _serve(tiny, tmp_path, "--num-requests", "3", "--repeat", "2", "--warmup-rounds", "1")
    assert len([c for c in engine_calls if c[0] == "reset"]) == 3, "one warm-up round and two counted"
    (r,) = doc["results"]
    assert len(r["warmup_rounds"]) == 1 and len(r["rounds"]) == 2
    assert r["duration_s"] == min(x["duration_s"] for x in r["rounds"]), "the median of two counted rounds"


@pytest.mark.parametrize("reset", [True, False])
def test_cli_repeat_with_a_shared_prefix_hits_the_same_in_every_round(tiny, tmp_path, monkeypatch, reset):
    """Two at a time: in each round the first two compute the 40-token prefix and the other
    four reuse its 2 full blocks of 16. Without the reset before each run, round 2 would hit
    round 1's prompts too."""
    from ingot.engine.engine import Engine

    if not reset:
        monkeypatch.setattr(Engine, "reset_prefix_cache", lambda self: True)
    doc = _serve(tiny, tmp_path, "--num-requests", "6", "--shared-prefix-len", "40", "--max-num-seqs", "2",
                 "--repeat", "2")
    (on,) = doc["results"]
    _check_consistent(doc, Workload(6, (8, 32), (8, 32), seed=5, shared_prefix_len=40))
    first_round = 128 / on["input_tokens"]
    hit_rates = [x["prefix_cache_hit_rate"] for x in on["rounds"]]
    assert hit_rates[0] == pytest.approx(first_round)
    if reset:
        assert hit_rates[1] == pytest.approx(first_round) and on["prefix_cache_hits"] == 128
    else:  # round 2 finds every full block of round 1's prompts (less the last token's)
        drawn = make_requests(Workload(6, (8, 32), (8, 32), seed=5, shared_prefix_len=40), TINY["vocab_size"])
        everything = sum((len(q.prompt_token_ids) - 1) // 16 * 16 for q in drawn) / on["input_tokens"]
        assert hit_rates[1] == pytest.approx(everything) and everything > 2 * first_round


def test_cli_repeat_needs_a_local_engine(capsys):
    argv = ["bench", "serve", "--url", "http://127.0.0.1:9", "--repeat", "2", "--quiet"]
    assert main(argv) == 2
    assert "--repeat and --warmup-rounds run on a local engine only" in capsys.readouterr().err


def test_cli_overlap_scheduling_and_repeat_parsing(capsys):
    from ingot.bench.serve_cli import llm_kwargs
    from ingot.cli import build_parser

    parse = build_parser().parse_args
    args = parse(["bench", "serve"])
    assert not args.no_overlap_scheduling and args.repeat == 1 and args.warmup_rounds == 0
    assert parse(["bench", "serve", "--warmup-rounds", "0"]).warmup_rounds == 0
    kw = llm_kwargs(parse(["bench", "serve", "--no-overlap-scheduling", "--shape", "qwen2.5-7b", "--repeat", "4"]), False)
    assert kw["overlap_scheduling"] is False and kw["enable_prefix_caching"] is True
    assert (kw["model"], kw["load_format"]) == ("qwen2.5-7b", "dummy")
    for bad in (["--repeat", "0"], ["--repeat", "two"], ["--prefix-caching", "on,off"], ["--warmup-rounds", "-1"]):
        with pytest.raises(SystemExit):
            main(["bench", "serve", *bad])
