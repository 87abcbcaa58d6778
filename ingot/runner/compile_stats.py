"""What Dynamo did while a bucket warmed up: graph breaks, recompiles (with reasons),
graphs and compile seconds, read from whatever bookkeeping the installed PyTorch keeps."""

from __future__ import annotations

import collections
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class StatsSnapshot:
    """Dynamo's bookkeeping at one moment (see ``stats_snapshot``)."""

    time: float
    metrics: Optional[tuple[Any, ...]]  # CompilationMetrics records (kept alive: compared by identity)
    break_records: Optional[int]  # len(torch._dynamo.utils.graph_break_reasons)
    break_tail: Any  # its last record (identity tells a reset() apart from growth)
    break_counts: dict[str, int]  # counters["graph_break"]
    guard_failures: dict[Any, tuple[list, int]]  # code -> (its reasons list, length)
    unique_graphs: int
    compile_inner: Optional[tuple[int, float]]  # compilation_time_metrics["_compile.compile_inner"]


@dataclass
class CompileStats:
    """What Dynamo did between a snapshot and now (one bucket's warm-up)."""

    graph_breaks: int = 0
    graph_break_reasons: list[str] = field(default_factory=list)
    recompiles: int = 0
    recompile_reasons: list[str] = field(default_factory=list)
    frames: int = 0  # frames Dynamo compiled (first compiles + recompiles, resume functions too)
    graphs: int = 0  # graphs handed to the backend
    compile_seconds: Optional[float] = None  # Dynamo + backend time; None if unknown
    wall_seconds: float = 0.0

    def describe(self) -> str:
        secs = "?" if self.compile_seconds is None else f"{self.compile_seconds:.2f}s"
        parts = [
            f"{self.graphs} graph(s) from {self.frames} frame(s) in {secs}",
            f"{self.graph_breaks} graph break(s)",
            f"{self.recompiles} recompile(s)",
        ]
        text = ", ".join(parts)
        for reason, n in collections.Counter(self.graph_break_reasons).items():
            text += f"\n  break x{n}: {reason}"
        for reason, n in collections.Counter(self.recompile_reasons).items():
            text += f"\n  recompile x{n}: {reason}"
        return text


def _utils() -> Any:
    import torch._dynamo.utils as utils

    return utils


def _metrics_records() -> Optional[tuple[Any, ...]]:
    get = getattr(_utils(), "get_compilation_metrics", None)
    if get is None:
        return None
    return tuple(get())


def stats_snapshot() -> StatsSnapshot:
    """Dynamo's counters now; pass to ``stats_since`` after warm-up."""
    utils = _utils()
    counters = utils.counters
    metrics = None
    with contextlib.suppress(Exception):
        metrics = _metrics_records()
    reasons = getattr(utils, "graph_break_reasons", None)
    inner = getattr(utils, "compilation_time_metrics", {}).get("_compile.compile_inner")
    return StatsSnapshot(
        time=time.perf_counter(),
        metrics=metrics,
        break_records=len(reasons) if isinstance(reasons, list) else None,
        break_tail=reasons[-1] if isinstance(reasons, list) and reasons else None,
        break_counts=dict(counters["graph_break"]),
        guard_failures={code: (v, len(v)) for code, v in getattr(utils, "guard_failures", {}).items()},
        unique_graphs=counters["stats"]["unique_graphs"],
        compile_inner=(len(inner), sum(inner)) if inner is not None else None,
    )


def _first_line(text: Any) -> str:
    lines = str(text).strip().splitlines()
    return lines[0].strip() if lines else ""


def _break_reasons(snap: StatsSnapshot) -> list[str]:
    """One entry per graph break since ``snap``: 'reason (file:line)'."""
    utils = _utils()
    records = getattr(utils, "graph_break_reasons", None)
    if snap.break_records is not None and isinstance(records, list):
        start = snap.break_records
        if start and (len(records) < start or records[start - 1] is not snap.break_tail):
            start = 0  # torch._dynamo.reset() cleared the list since the snapshot
        out = []
        for rec in records[start:]:
            text = _first_line(getattr(rec, "reason", rec))
            stack = getattr(rec, "user_stack", None) or []
            if stack:
                frame = stack[-1]
                text += f" ({frame.filename}:{frame.lineno})"
            out.append(text)
        return out
    out = []
    for reason, n in utils.counters["graph_break"].items():
        out.extend([_first_line(reason)] * max(0, n - snap.break_counts.get(reason, 0)))
    return out


def stats_since(snap: StatsSnapshot) -> CompileStats:
    """Graph breaks, recompiles (with reasons), graphs and compile seconds since ``snap``.

    Sources, in order of preference (all degrade to what the version has):
    ``torch._dynamo.utils.get_compilation_metrics()`` (one record per compiled
    frame, with ``recompile_reason`` and ``entire_frame_compile_time_s``),
    ``utils.graph_break_reasons`` / ``counters["graph_break"]`` and, if the
    metrics are missing, ``utils.guard_failures`` (which lists one reason per
    failing cache entry, so it over-counts) and ``compilation_time_metrics``.
    The metrics deque keeps the last 64 records: a bucket compiling more
    frames than that loses the oldest. Compiles in other threads are counted too.
    """
    stats = CompileStats(wall_seconds=time.perf_counter() - snap.time)
    utils = _utils()
    with contextlib.suppress(Exception):
        reasons = _break_reasons(snap)
        stats.graph_breaks, stats.graph_break_reasons = len(reasons), reasons
    with contextlib.suppress(Exception):
        stats.graphs = max(0, utils.counters["stats"]["unique_graphs"] - snap.unique_graphs)

    records = None
    with contextlib.suppress(Exception):
        records = _metrics_records() if snap.metrics is not None else None
    if records is not None and all(hasattr(m, "recompile_reason") for m in records):
        seen = {id(m) for m in snap.metrics or ()}
        new = [m for m in records if id(m) not in seen]
        seconds = 0.0
        for m in new:
            # runtime records: compile work done at the first call (Triton compile/autotune)
            if not getattr(m, "is_runtime", False):
                stats.frames += 1
            if m.recompile_reason:
                stats.recompiles += 1
                stats.recompile_reasons.append(f"{getattr(m, 'co_name', '?')}: {_first_line(m.recompile_reason)}")
            micros = getattr(m, "duration_us", None)
            seconds += micros / 1e6 if micros else getattr(m, "entire_frame_compile_time_s", None) or 0.0
        stats.compile_seconds = seconds
        return stats

    with contextlib.suppress(Exception):  # older layout: guard failures (an upper bound)
        for code, failures in getattr(utils, "guard_failures", {}).items():
            old, before = snap.guard_failures.get(code, (None, 0))
            fresh = failures[before:] if old is failures else failures
            for reason in fresh:
                stats.recompile_reasons.append(f"{getattr(code, 'co_name', '?')}: {_first_line(reason)}")
        stats.recompiles = len(stats.recompile_reasons)
    with contextlib.suppress(Exception):
        inner = getattr(utils, "compilation_time_metrics", {}).get("_compile.compile_inner")
        if inner is not None:
            count, total = snap.compile_inner or (0, 0.0)
            if len(inner) < count:
                count, total = 0, 0.0
            stats.frames = len(inner) - count
            stats.compile_seconds = max(0.0, sum(inner) - total)
    return stats
