"""Drift metrics on known token streams, and the drift check end to end on CPU."""

from __future__ import annotations

import pytest

from ingot import LLM
from ingot.bench.drift import DecodeModes, compare_free_running, first_divergence, free_running, teacher_forced
from tests.helpers import write_tiny_checkpoint


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_compare_free_running_counts():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    got = [[1, 2, 3, 4], [5, 6, 9, 9]]
    r = compare_free_running("compiled", "graph", 8, got, ref)
    assert r.identical == 1 and r.total == 2
    assert r.first_divergence == [None, 2]
    assert r.token_agreement == pytest.approx(6 / 8)


def test_drift_check_on_cpu_fake_graphs(tmp_path, cpu_buckets):
    path = write_tiny_checkpoint(tmp_path / "llama", "llama")
    llm = LLM(str(path), dtype="float32", device="cpu", show_progress=False, max_num_seqs=4)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in ["hello world", "the quick brown", "def f(x)"]]
    modes = DecodeModes(llm.engine, bucket=4)
    assert modes.modes == ["eager", "graph"]  # no compile on CPU
    tf = teacher_forced(modes, prompts, steps=6, reference="graph")
    assert len(tf) == 1 and tf[0].mode == "eager"
    assert tf[0].top1_agreement == 1.0 and tf[0].max_rel_logit_err < 1e-5
    fr = free_running(modes, prompts, steps=6, reference="graph")
    assert fr[0].identical == 3
