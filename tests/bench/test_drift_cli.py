"""`ingot check drift`: parsing, prompt files, the per-bucket table, and the command end to end on CPU."""

from __future__ import annotations

import json

import pytest

from ingot.bench import drift_cli, report
from ingot.bench.drift import FreeRunning, TeacherForced
from ingot.cli import build_parser, main
from tests.helpers import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("drift") / "llama", "llama")


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("hello world\n\nthe quick brown fox\ndef f(x): return x * 2\n")
    return path


# ---------------------------------------------------------------------- parsing
def test_parse_defaults():
    args = build_parser().parse_args(["check", "drift"])
    assert args.func is drift_cli.cmd_drift
    assert args.model is None and args.prompts is None
    assert args.steps == 128 and args.buckets == [1, 8] and args.threshold == 0.995
    assert args.json is None and not args.fake_graphs
    assert args.dtype == "auto" and args.device == "auto"


def test_parse_options():
    args = build_parser().parse_args([
        "check", "drift", "--model", "m", "--prompts", "p.txt", "--steps", "4", "--buckets", "1,2",
        "--threshold", "0.99", "--json", "d.json", "--dtype", "float32", "--device", "cpu", "--fake-graphs",
    ])
    assert (args.model, args.prompts, args.steps, args.buckets) == ("m", "p.txt", 4, [1, 2])
    assert (args.threshold, args.json, args.dtype, args.device, args.fake_graphs) == (0.99, "d.json", "float32", "cpu", True)


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--buckets", "1,-2"], ["--threshold", "x"], ["--threshold", "-0.1"]])
def test_parse_rejects(argv):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["check", "drift", *argv])
    assert exc.value.code == 2


# ---------------------------------------------------------------------- prompts
def test_builtin_prompts():
    prompts = drift_cli.builtin_prompts()
    assert len(prompts) == 8
    assert sum(isinstance(p, list) for p in prompts) == 3  # chat-templated


def test_read_prompts(prompt_file, tmp_path):
    assert drift_cli.read_prompts(str(prompt_file)) == ["hello world", "the quick brown fox", "def f(x): return x * 2"]
    with pytest.raises(drift_cli.DriftInputError, match="cannot read"):
        drift_cli.read_prompts(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(drift_cli.DriftInputError, match="no prompt"):
        drift_cli.read_prompts(str(tmp_path / "empty.txt"))


def test_encode_prompts_chat_and_plain():
    class Tok:
        def encode(self, text):
            return [len(text)]

        def encode_chat(self, messages):
            return [100 + len(messages)]

    class NoTemplate(Tok):
        def encode_chat(self, messages):
            raise ValueError("this model has no chat template")

    convo = [{"role": "system", "content": "ab"}, {"role": "user", "content": "cde"}]
    assert drift_cli.encode_prompts(Tok(), ["hello", convo]) == [[5], [102]]
    assert drift_cli.encode_prompts(NoTemplate(), [convo]) == [[len("ab\ncde")]]


# ---------------------------------------------------------------------- table on fabricated results
def test_bucket_table_and_gate():
    assert drift_cli.gated_mode(["eager", "graph", "compiled"]) == "compiled"
    assert drift_cli.gated_mode(["eager", "graph"]) == "eager"
    tf = [TeacherForced("eager", "graph", 8, 128, 0.9875, 3.2e-2, 1e-3, 0.25, False),
          TeacherForced("compiled", "graph", 8, 128, 0.992, 9.96e-2, 1.94e-2, 0.5, False)]
    fr = [FreeRunning("eager", "graph", 8, 7, 8, 0.99, [None] * 7 + [40]),
          FreeRunning("compiled", "graph", 8, 1, 8, 0.5, [17, 46, None, 20, 21, 22, 23, 24])]
    text = report.table_text(drift_cli.bucket_table(8, tf, fr, "compiled", 0.995))
    for needle in ["bucket 8", "128 steps", "98.75%", "99.20% FAIL", "9.96e-02", "5.00e-01", "7/8", "1/8", "40",
                   "17, 46, 20", "no"]:
        assert needle in text, needle
    ok = report.table_text(drift_cli.bucket_table(8, tf, fr, "compiled", 0.99))
    assert "99.20% ok" in ok


# ---------------------------------------------------------------------- end to end on CPU
def _argv(tiny, prompt_file, *extra):
    return ["check", "drift", "--model", str(tiny), "--prompts", str(prompt_file), "--steps", "4", "--buckets", "1,2",
            "--device", "cpu", "--dtype", "float32", "--fake-graphs", "--max-model-len", "32", *extra]  # short: fast on CPU


def test_fake_graphs_end_to_end(tiny, prompt_file, tmp_path, capsys):
    out = tmp_path / "drift.json"
    assert main(_argv(tiny, prompt_file, "--json", str(out))) == 0
    printed = capsys.readouterr().out
    assert "bucket 1" in printed and "bucket 2" in printed and "PASS" in printed
    data = json.loads(out.read_text())
    assert data["passed"] is True and data["fake_graphs"] is True
    assert data["steps"] == 4 and data["threshold"] == 0.995 and data["reference"] == "graph"
    assert data["prompts"]["count"] == 3 and data["device"] == "cpu" and data["dtype"] == "float32"
    assert set(data["buckets"]) == {"1", "2"}
    for bucket, entry in data["buckets"].items():
        assert entry["modes"] == ["eager", "graph"] and entry["gated_mode"] == "eager" and entry["passed"]
        (tf,) = entry["teacher_forced"]
        assert tf["mode"] == "eager" and tf["bucket"] == int(bucket) and tf["top1_agreement"] == 1.0
        (fr,) = entry["free_running"]
        assert fr["identical"] == fr["total"] == 3


def test_threshold_above_agreement_exits_1(tiny, prompt_file, tmp_path, capsys):
    out = tmp_path / "drift.json"
    assert main(_argv(tiny, prompt_file, "--threshold", "1.01", "--json", str(out))) == 1
    captured = capsys.readouterr()
    assert "FAIL: bucket 1: eager top-1 agreement 100.00% < 101.00%" in captured.out
    assert "cannot pass" in captured.err
    assert json.loads(out.read_text())["passed"] is False


def test_cpu_without_fake_graphs_exits_2(tiny, prompt_file, capsys):
    argv = [a for a in _argv(tiny, prompt_file) if a != "--fake-graphs"]
    assert main(argv) == 2
    assert "--fake-graphs" in capsys.readouterr().err


def test_steps_beyond_max_model_len_exits_2(tiny, prompt_file, capsys):
    assert main(_argv(tiny, prompt_file, "--max-model-len", "8")) == 2  # the later value wins
    assert "max_model_len" in capsys.readouterr().err


def test_tensor_parallel_end_to_end(tiny, prompt_file, tmp_path, capsys):
    """--tp 2: every mode is built and replayed on both ranks (a CPU worker over gloo)."""
    out = tmp_path / "drift.json"
    assert main(_argv(tiny, prompt_file, "--tp", "2", "--json", str(out))) == 0
    data = json.loads(out.read_text())
    assert data["passed"] is True and data["tensor_parallel_size"] == 2
    for entry in data["buckets"].values():
        (tf,) = entry["teacher_forced"]
        assert tf["top1_agreement"] == 1.0 and tf["max_rel_logit_err"] < 1e-6
        (fr,) = entry["free_running"]
        assert fr["identical"] == fr["total"] == 3
