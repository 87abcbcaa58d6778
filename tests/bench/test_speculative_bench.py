"""Speculative decoding in `ingot bench serve` (--speculative-config, --compare-speculative, the
copy workload) and `ingot check drift --speculative-config`, on CPU."""

from __future__ import annotations

import json

import pytest

from ingot.bench import serve as serve_mod
from ingot.bench.serve import RequestRecord, SpecCounts, add_engine_counters, compute_metrics
from ingot.bench.spec_drift import SpeculativeDrift, failures
from ingot.bench.speculation import speedup
from ingot.cli import main
from ingot.engine.speculative import Speculator
from ingot.engine.stats import EngineStats
from tests.helpers import write_tiny_checkpoint

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "llama", "llama")


# ---------------------------------------------------------------- options
@pytest.mark.parametrize("command", [["bench", "serve"], ["check", "drift"]])
@pytest.mark.parametrize("text, reason", [
    ('{"method": "ngram"', "not JSON"),
    ("[4]", "must be a JSON object"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "lookup": 2}', "unknown field(s) ['lookup']"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer"),
    ('{"method": "medusa", "num_speculative_tokens": 2}', "method must be one of"),
])
def test_bad_speculative_config_is_a_clear_error(command, text, reason, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*command, "--speculative-config", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --speculative-config" in err and reason in err


def test_compare_needs_a_speculative_config_and_a_local_engine(capsys):
    assert main(["bench", "serve", "--compare-speculative"]) == 2
    assert "--compare-speculative needs --speculative-config" in capsys.readouterr().err
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--speculative-config", NGRAM]) == 2
    assert "ingot serve --speculative-config" in capsys.readouterr().err


# ---------------------------------------------------------------- counts and ratios (pure)
def test_spec_counts_sum_over_requests_and_engine_counters_fill_in_over_http():
    records = [RequestRecord(4, 3, 0.0, [1.0, 1.5, 2.0], spec=SpecCounts(2, 8, 5)),
               RequestRecord(4, 3, 0.0, [1.0, 1.5, 2.0], spec=SpecCounts(1, 4, 1)),
               RequestRecord(4, 3, 0.0, [1.0, 1.5, 2.0])]
    m = compute_metrics(records, 0.0, 2.0)
    assert (m.spec_num_drafts, m.spec_num_draft_tokens, m.spec_num_accepted_tokens) == (3, 12, 6)
    assert m.spec_acceptance_rate == 0.5 and m.spec_mean_accepted_length == 2.0
    assert [r["spec_num_accepted_tokens"] for r in m.requests] == [5, 1, 0]
    before = EngineStats(spec_decode_num_drafts=10, spec_decode_num_draft_tokens=40, spec_decode_num_accepted_tokens=30)
    after = EngineStats(spec_decode_num_drafts=14, spec_decode_num_draft_tokens=56, spec_decode_num_accepted_tokens=34)
    add_engine_counters(m, before, after)  # the requests' own counts stay
    assert (m.spec_num_drafts, m.spec_acceptance_rate) == (3, 0.5)
    http = compute_metrics([RequestRecord(4, 3, 0.0, [1.0, 1.5, 2.0])], 0.0, 2.0)  # a client sees no counts
    assert http.spec_acceptance_rate is None and http.spec_mean_accepted_length is None
    add_engine_counters(http, before, after)
    assert (http.spec_num_drafts, http.spec_num_draft_tokens, http.spec_num_accepted_tokens) == (4, 16, 4)
    assert http.spec_acceptance_rate == 0.25 and http.spec_mean_accepted_length == 1.0


def test_speedup_is_the_median_of_paired_rounds():
    assert speedup([100.0, 200.0, 100.0], [250.0, 300.0, 150.0]) == {"median": 1.5, "rounds": [2.5, 1.5, 1.5]}
    with pytest.raises(ValueError):
        speedup([1.0], [])


# ---------------------------------------------------------------- bench serve
def test_compare_speculative_alternates_plain_and_speculative_runs_on_one_engine(tiny, tmp_path, monkeypatch):
    real = serve_mod.run_workload
    calls = []

    def recording(engine, requests, **kw):
        calls.append((id(engine), engine.spec is not None))
        return real(engine, requests, **kw)

    monkeypatch.setattr(serve_mod, "run_workload", recording)
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--model", str(tiny), "--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
            "--workload", "copy", "--num-requests", "2", "--input-len", "80-100", "--output-len", "8", "--repeat", "2",
            "--warmup-rounds", "1", "--speculative-config", NGRAM, "--compare-speculative", "--quiet", "--json", str(out)]
    assert main(argv) == 0
    assert len({engine for engine, _ in calls}) == 1
    # warm-up round, then two counted rounds; plain first in even rounds, speculative first in odd ones
    assert [spec for _, spec in calls] == [False, True, True, False, False, True]
    doc = json.loads(out.read_text())
    assert doc["workload"]["kind"] == "copy" and doc["environment"]["speculative_config"]["num_speculative_tokens"] == 4
    plain, spec = doc["results"]
    assert plain["speculative"] == "plain" and spec["speculative"] == "ngram k=4 (lookup 2-5)"
    assert plain["spec_num_drafts"] == 0 and all(r["spec_num_draft_tokens"] == 0 for r in plain["requests"])
    ratios = [s["output_throughput"] / p["output_throughput"] for p, s in zip(plain["rounds"], spec["rounds"])]
    assert spec["speedup"]["rounds"] == pytest.approx(ratios)
    assert spec["speedup"]["median"] == pytest.approx(sum(ratios) / 2)
    assert "speedup" not in plain


def test_compare_speculative_with_a_draft_model_keeps_the_draft_out_of_plain_runs(tiny, tmp_path, monkeypatch):
    """With a draft model (here the target itself) the plain runs leave the draft idle: it runs
    only in the speculative ones (which keep most drafts: the draft proposes only the 300
    tokens of the tokenizer, the target's table has 384 rows)."""
    from ingot.runner.model_runner import ModelRunner

    real = serve_mod.run_workload
    calls = []
    fill = ModelRunner.fill_kv
    monkeypatch.setattr(ModelRunner, "fill_kv", lambda self, inputs: calls.append("draft") or fill(self, inputs))

    def recording(engine, requests, **kw):
        calls.append("speculative" if engine.spec is not None else "plain")
        return real(engine, requests, **kw)

    monkeypatch.setattr(serve_mod, "run_workload", recording)
    out = tmp_path / "serve.json"
    spec = json.dumps({"model": str(tiny), "num_speculative_tokens": 3})
    argv = ["bench", "serve", "--model", str(tiny), "--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
            "--num-requests", "2", "--input-len", "20", "--output-len", "12", "--repeat", "2", "--warmup-rounds", "0",
            "--speculative-config", spec, "--compare-speculative", "--quiet", "--json", str(out)]
    assert main(argv) == 0
    runs = "".join("|" + c if c != "draft" else "d" for c in calls).split("|")[1:]
    assert runs[0].startswith("plain") and runs[1].startswith("speculative")  # round 1: plain first
    assert all(not r.endswith("d") for r in runs if r.startswith("plain")), "plain runs never ran the draft"
    assert all(r.endswith("d") for r in runs if r.startswith("speculative"))
    plain, spec_result = json.loads(out.read_text())["results"]
    assert spec_result["speculative"] == f"draft k=3 ({tiny.name})" and plain["spec_num_drafts"] == 0
    assert spec_result["spec_num_draft_tokens"] >= spec_result["spec_num_accepted_tokens"] > 0


def test_copy_workload_speculates_on_the_default_model(smollm2_gguf, tmp_path, capsys):
    """The default model copies: drafts from the prompt are kept."""
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--device", "cpu", "--max-model-len", "256", "--workload", "copy", "--num-requests", "2",
            "--input-len", "100", "--output-len", "16", "--seed", "1", "--speculative-config", NGRAM, "--quiet",
            "--json", str(out)]
    assert main(argv) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["output_tokens"] == 32 and r["input_tokens"] == 200
    assert r["spec_num_drafts"] > 0 and r["spec_num_accepted_tokens"] > 0
    assert 0 < r["spec_acceptance_rate"] <= 1
    assert r["spec_acceptance_rate"] == pytest.approx(r["spec_num_accepted_tokens"] / r["spec_num_draft_tokens"])
    assert r["spec_mean_accepted_length"] == pytest.approx(r["spec_num_accepted_tokens"] / r["spec_num_drafts"])
    assert sum(q["spec_num_accepted_tokens"] for q in r["requests"]) == r["spec_num_accepted_tokens"]
    printed = capsys.readouterr().out
    assert "spec acceptance rate" in printed and "2 copy requests" in printed


# ---------------------------------------------------------------- check drift
COPYING = ["Copy this sentence: the quick brown fox jumps over the lazy dog near the river bank. Copy: the quick brown fox",
           "Colours: red, green, blue, yellow, purple, orange, red, green, blue, yellow, purple, orange, red,"]


def _drift(tmp_path, *extra):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(COPYING) + "\n")
    out = tmp_path / "drift.json"
    argv = ["check", "drift", "--speculative-config", NGRAM, "--prompts", str(prompts), "--steps", "12", "--buckets", "2",
            "--device", "cpu", "--dtype", "float32", "--max-model-len", "128", "--json", str(out), *extra]
    return main(argv), out


def test_drift_speculative_is_exact_on_cpu(smollm2_gguf, tmp_path, capsys):
    code, out = _drift(tmp_path, "--threshold", "1")
    printed = capsys.readouterr().out
    assert code == 0, printed
    doc = json.loads(out.read_text())
    assert doc["passed"] and doc["reference"] == "plain" and doc["speculative_config"]["num_speculative_tokens"] == 4
    b = doc["buckets"]["2"]
    assert b["identical"] == b["total"] == 2 and b["token_agreement"] == 1.0 and b["first_divergence"] == [None, None]
    assert b["teacher_forced_agreement"] == 1.0 and b["max_logprob_gap"] == 0.0
    assert b["spec_num_accepted_tokens"] > 0 and b["spec_num_accepted_tokens"] < b["spec_num_draft_tokens"]
    assert "PASS" in printed


def test_drift_with_the_default_model_as_its_own_draft_is_exact_on_cpu(smollm2_gguf, tmp_path, capsys):
    spec = json.dumps({"model": str(smollm2_gguf), "num_speculative_tokens": 4})
    code, out = _drift(tmp_path, "--threshold", "1", "--speculative-config", spec)
    printed = capsys.readouterr().out
    assert code == 0, printed
    b = json.loads(out.read_text())["buckets"]["2"]
    assert b["identical"] == b["total"] == 2 and b["teacher_forced_agreement"] == 1.0
    assert 0 < b["spec_num_accepted_tokens"] == b["spec_num_draft_tokens"]


def _accept_every_draft(monkeypatch):
    """A broken verifier: every row keeps all its drafts (then the token it sampled)."""
    real = Speculator.finish

    def finish(self, engine, flight):
        collect, drafts = flight.step.collect, flight.batch.draft_tokens

        def wrong():
            out = collect()
            for row, draft in enumerate(drafts):
                if draft and out.num_accepted[row] < len(draft):
                    out.tokens[row] = [*draft, out.tokens[row][-1]]
                    out.num_accepted[row] = len(draft)
            return out

        flight.step.collect = wrong
        return real(self, engine, flight)

    monkeypatch.setattr(Speculator, "finish", finish)


def test_drift_speculative_fails_when_the_verifier_keeps_wrong_drafts(smollm2_gguf, tmp_path, monkeypatch, capsys):
    _accept_every_draft(monkeypatch)
    code, out = _drift(tmp_path)
    printed = capsys.readouterr().out
    assert code == 1, printed
    b = json.loads(out.read_text())["buckets"]["2"]
    assert not b["passed"] and b["teacher_forced_agreement"] < 0.995 and b["max_logprob_gap"] > 0
    assert b["spec_acceptance_rate"] == 1.0 and b["identical"] < 2
    assert "FAIL: bucket 2: teacher-forced agreement with plain decoding" in printed


def test_drift_speculative_without_drafts_fails(tiny, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nthe quick brown fox\n")
    never = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1})
    argv = ["check", "drift", "--model", str(tiny), "--speculative-config", never, "--prompts", str(prompts),
            "--steps", "4", "--buckets", "2", "--device", "cpu", "--max-model-len", "32"]
    assert main(argv) == 1
    assert "bucket 2: speculation proposed no drafts" in capsys.readouterr().out


def test_drift_speculative_refuses_fake_graphs(tiny, capsys):
    argv = ["check", "drift", "--model", str(tiny), "--speculative-config", NGRAM, "--fake-graphs", "--device", "cpu"]
    assert main(argv) == 2
    assert "--fake-graphs compares decode modes" in capsys.readouterr().err


def test_failures_name_each_failing_bucket():
    ok = SpeculativeDrift(1, 8, 2, 2, 1.0, [None, None], 1.0, 0.0, SpecCounts(3, 12, 9))
    low = SpeculativeDrift(8, 8, 1, 2, 0.75, [None, 3], 0.99, 0.4, SpecCounts(3, 12, 12))
    none = SpeculativeDrift(64, 8, 2, 2, 1.0, [None, None], 1.0, 0.0, SpecCounts())
    assert failures([ok], 0.995) == []
    lines = failures([ok, low, none], 0.995)
    assert lines[0] == "bucket 8: teacher-forced agreement with plain decoding 99.00% < 99.50%"
    assert lines[1].startswith("bucket 64: speculation proposed no drafts")
    assert ok.to_json(0.995)["spec_acceptance_rate"] == 0.75 and not none.to_json(0.995)["passed"]
