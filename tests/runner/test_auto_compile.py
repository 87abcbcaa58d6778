"""decode_compile="auto": the per-bucket decision (pure) and its wiring in the graph runner (fake capture)."""

from __future__ import annotations

import time

import pytest
import torch

from ingot import LLM, SamplingParams
from ingot.config import EngineConfig
from ingot.runner import auto_compile, graph_runner
from ingot.runner.auto_compile import ProbeDrift, decide, noise_ms
from tests.helpers import write_tiny_checkpoint

CLEAN = ProbeDrift(1.0, 0.0)


def test_noise_is_half_iqr_with_a_floor():
    # quartiles of 1..8 (exclusive method): 2.25 and 6.75 -> half IQR 2.25
    assert noise_ms([1, 2, 3, 4, 5, 6, 7, 8]) == pytest.approx(2.25)
    assert noise_ms([10.0] * 6) == pytest.approx(0.1)  # 1% of the median when timings agree


def test_decide_keeps_compiled_only_when_faster_beyond_noise_and_clean():
    raw = [2.0, 2.01, 1.99, 2.0, 2.02, 1.98]
    assert decide(8, raw, [1.5] * 6, CLEAN, 1e-3).use_compiled
    slower = decide(8, raw, [2.1] * 6, CLEAN, 1e-3)
    assert not slower.use_compiled and "not faster" in slower.reason
    within_noise = decide(8, raw, [1.99] * 6, CLEAN, 1e-3)
    assert not within_noise.use_compiled
    drifting = decide(8, raw, [1.0] * 6, ProbeDrift(0.875, 0.2), 1e-3)
    assert not drifting.use_compiled and "drifts" in drifting.reason
    small_err = decide(8, raw, [1.0] * 6, ProbeDrift(1.0, 5e-4), 1e-3)
    assert small_err.use_compiled


def test_probe_drift_measure():
    raw = torch.tensor([[1.0, 2.0, 0.0], [0.0, 1.0, 3.0]])
    same = ProbeDrift.measure(raw.clone(), raw)
    assert same.top1_agreement == 1.0 and same.max_rel_err == 0.0
    flipped = raw.clone()
    flipped[1] = torch.tensor([4.0, 1.0, 3.0])
    d = ProbeDrift.measure(flipped, raw)
    assert d.top1_agreement == 0.5
    assert d.max_rel_err == pytest.approx(4.0 / (10.0**0.5))


def test_decision_table_lists_every_bucket():
    rows = [decide(1, [2.0] * 4, [1.0] * 4, CLEAN, 1e-3), decide(8, [2.0] * 4, [2.5] * 4, CLEAN, 1e-3)]
    table = auto_compile.decision_table(rows).splitlines()
    assert len(table) == 3 and "compiled" in table[1] and "graph" in table[2]


def test_auto_env_value():
    assert EngineConfig.create(env={"INGOT_DECODE_COMPILE": "auto"}).decode_compile == "auto"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("auto") / "llama", "llama")


def _fake_compile(monkeypatch, perturb: float, delay: float = 0.0):
    """Stand in a 'compiled' forward (CPU has no compile) that may shift the logits or be slow."""

    def build(forward, config, device):
        def compiled(*args):
            if delay:
                time.sleep(delay)
            return forward(*args) + perturb

        compiled.compiled = True
        return compiled

    monkeypatch.setattr(graph_runner.decode_compile, "build_decode_forward", build)


def _llm(tiny) -> LLM:
    return LLM(str(tiny), dtype="float32", device="cpu", show_progress=False, max_num_seqs=4, decode_compile="auto")


@pytest.fixture(autouse=True)
def _cpu_buckets(cpu_buckets):
    """Every engine here decodes through the padded bucket path."""


def test_auto_picks_compiled_where_timings_say_so(tiny, monkeypatch):
    _fake_compile(monkeypatch, perturb=0.0)
    calls = iter(range(10**6))

    def fake_time(fn, iters, device, warmup=3):
        fn()
        return [2.0] * iters if next(calls) % 2 == 0 else [1.0] * iters  # raw timed first, then compiled

    monkeypatch.setattr(auto_compile, "time_ms", fake_time)
    llm = _llm(tiny)
    runner = llm.engine.executor.graphs
    assert sorted(runner.decisions) == [1, 2, 4]
    assert all(d.use_compiled for d in runner.decisions.values())
    assert all(e.compiled for e in runner.entries.values())
    out = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_auto_rejects_a_drifting_compiled_forward(tiny, monkeypatch):
    _fake_compile(monkeypatch, perturb=0.5)
    monkeypatch.setattr(auto_compile, "time_ms", lambda fn, iters, device, warmup=3: [1.0] * iters)
    runner = _llm(tiny).engine.executor.graphs
    assert not any(d.use_compiled for d in runner.decisions.values())
    assert not runner.compiled
    # and the graph runner's padded buffers were reset after the probe
    assert int(runner.buffers.input_ids.abs().sum()) == 0


def test_auto_keeps_graph_when_compiled_is_slower_real_timings(tiny, monkeypatch):
    _fake_compile(monkeypatch, perturb=0.0, delay=0.03)
    runner = _llm(tiny).engine.executor.graphs
    assert not any(d.use_compiled for d in runner.decisions.values())
