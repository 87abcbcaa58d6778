"""`ingot bench serve` end to end on a tiny checkpoint (CPU): the JSON it writes against the
drawn workload, prefix caching on and off, multi-turn runs, flags, and --repeat's rounds on one
engine. Metrics: test_serve_metrics.py; workload: test_serve_workload.py; driver:
test_serve_driver.py."""

from __future__ import annotations

import gc
import json

import pytest

from ingot.bench.workload import Workload, make_requests
from ingot.cli import main
from tests.helpers import TINY, write_tiny_checkpoint


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
