"""ingot.runner.compile_stats (CPU): graph breaks and recompiles with their reasons, compile
time, from Dynamo's compilation metrics or, without them, its counters."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils as dynamo_utils

from ingot.config import EngineConfig
from ingot.runner import compile_stats as cs
from ingot.runner import decode_compile as dc
from tests.runner.compile_fixtures import clean_state, f_add  # noqa: F401  (clean_state: autouse)


def with_print(x):
    y = x * 2
    print("graph break here")
    return y + 1


def with_item(x):
    if (x.sum() > 0).item():
        return x + 1
    return x - 1


@pytest.mark.parametrize("fn", [with_print, with_item])
def test_stats_report_graph_breaks_with_reasons(fn, capsys):
    fwd = dc.build_decode_forward(fn, EngineConfig(decode_compile=True), "cpu", backend="eager", allow_cpu=True)
    snap = cs.stats_snapshot()
    out = fwd(torch.ones(3))
    stats = cs.stats_since(snap)
    assert torch.equal(out, fn(torch.ones(3)))
    assert stats.graph_breaks >= 1
    assert len(stats.graph_break_reasons) == stats.graph_breaks
    assert all(r for r in stats.graph_break_reasons)
    assert any(Path(__file__).name in r for r in stats.graph_break_reasons)  # where it broke
    text = stats.describe()
    assert "graph break" in text and "break x" in text
    # a second snapshot sees nothing new
    snap = cs.stats_snapshot()
    fwd(torch.ones(3))
    assert cs.stats_since(snap).graph_breaks == 0


def test_stats_report_recompiles_with_reasons():
    cfg = EngineConfig(decode_compile=True)
    fwd = dc.build_decode_forward(f_add, cfg, "cpu", backend="eager", allow_cpu=True)
    snap = cs.stats_snapshot()
    fwd(torch.ones(4))
    first = cs.stats_since(snap)
    assert (first.frames, first.recompiles) == (1, 0)
    snap = cs.stats_snapshot()
    fwd(torch.ones(5))  # recompiles with the size symbolic (automatic dynamic shapes) ...
    fwd(torch.ones(6))  # ... which this size reuses
    stats = cs.stats_since(snap)
    assert stats.recompiles == 1 and stats.frames == 1
    assert all(r.startswith("f_add:") for r in stats.recompile_reasons)
    assert any("size" in r for r in stats.recompile_reasons), stats.recompile_reasons
    assert stats.compile_seconds is not None and stats.compile_seconds > 0
    assert stats.wall_seconds >= stats.compile_seconds * 0.5
    assert "1 recompile(s)" in stats.describe()


def test_stats_from_compilation_metrics_records(monkeypatch):
    """Frame records count as frames (with recompile reasons); runtime records add compile time only."""

    def rec(**kw):
        base = dict(co_name="fwd", recompile_reason=None, is_runtime=False, duration_us=None, entire_frame_compile_time_s=None)
        return SimpleNamespace(**{**base, **kw})

    old = rec(duration_us=5_000_000)
    records = [old]
    monkeypatch.setattr(dynamo_utils, "get_compilation_metrics", lambda: list(records))
    snap = cs.stats_snapshot()
    records += [
        rec(duration_us=1_500_000, recompile_reason="0/0: tensor 'x' size mismatch at index 0. expected 4, actual 8"),
        rec(is_runtime=True, duration_us=250_000),
        rec(co_name="resume", entire_frame_compile_time_s=0.25),
    ]
    stats = cs.stats_since(snap)
    assert (stats.frames, stats.recompiles) == (2, 1)
    assert stats.recompile_reasons == ["fwd: 0/0: tensor 'x' size mismatch at index 0. expected 4, actual 8"]
    assert stats.compile_seconds == pytest.approx(2.0)


def test_stats_degrade_without_compilation_metrics(monkeypatch):
    monkeypatch.delattr(dynamo_utils, "get_compilation_metrics")
    monkeypatch.setattr(dynamo_utils, "graph_break_reasons", None)  # fall back to counters too
    fwd = dc.build_decode_forward(with_print, EngineConfig(decode_compile=True), "cpu", backend="eager", allow_cpu=True)
    fwd(torch.ones(2))
    snap = cs.stats_snapshot()
    fwd(torch.ones(3))
    stats = cs.stats_since(snap)
    assert stats.graph_breaks >= 1 and all(stats.graph_break_reasons)
    assert stats.recompiles >= 1  # guard failures: an upper bound
    assert stats.compile_seconds is not None


def test_stats_since_survives_dynamo_reset():
    fwd = dc.build_decode_forward(with_print, EngineConfig(decode_compile=True), "cpu", backend="eager", allow_cpu=True)
    fwd(torch.ones(2))
    snap = cs.stats_snapshot()
    torch._dynamo.reset()
    fwd(torch.ones(2))
    stats = cs.stats_since(snap)
    assert stats.graph_breaks >= 1 and stats.recompiles == 0
