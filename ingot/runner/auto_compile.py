"""``decode_compile="auto"``: keep a bucket's compiled graph only where it measurably pays.

For each bucket the graph runner captures both the raw and the compiled
forward, times their replays in the same run, and replays both on one probe
batch. This module holds the pure decision: the compiled graph is kept only if
it is faster by more than the measured noise and its probe logits do not drift
from the raw graph's. Auto is therefore never slower than graph-only, up to
the noise of the timing itself.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

# Relative spread (of the median) always assumed, even when repeated timings agree.
MIN_NOISE = 0.01
# The largest probe relative logit error a compiled bucket may show (with the default opaque
# op policy compiled decode is bitwise equal to the graph; a native op policy drifts more).
MAX_DRIFT = 1e-3


@dataclass
class ProbeDrift:
    """Compiled vs raw logits on one probe batch."""

    top1_agreement: float
    max_rel_err: float

    @classmethod
    def measure(cls, compiled: torch.Tensor, raw: torch.Tensor) -> "ProbeDrift":
        c, r = compiled.float(), raw.float()
        agree = (c.argmax(-1) == r.argmax(-1)).float().mean().item()
        rel = ((c - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-12)).max().item()
        return cls(agree, rel)


@dataclass
class BucketDecision:
    size: int
    use_compiled: bool
    raw_ms: float
    compiled_ms: float
    noise_ms: float
    drift: ProbeDrift
    reason: str

    @property
    def speedup(self) -> float:
        return self.raw_ms / self.compiled_ms if self.compiled_ms > 0 else float("nan")


def time_ms(fn: Callable[[], object], iters: int, device: torch.device, warmup: int = 3) -> list[float]:
    """Milliseconds of each of ``iters`` calls after ``warmup``: CUDA events on CUDA, a host clock elsewhere."""
    for _ in range(warmup):
        fn()
    out = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        return out
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def noise_ms(samples: Sequence[float]) -> float:
    """Half the interquartile range, at least MIN_NOISE of the median."""
    data = sorted(samples)
    med = statistics.median(data)
    if len(data) >= 4:
        q1, _, q3 = statistics.quantiles(data, n=4)
        half_iqr = (q3 - q1) / 2
    else:
        half_iqr = (data[-1] - data[0]) / 2
    return max(half_iqr, MIN_NOISE * med)


def decide(size: int, raw: Sequence[float], compiled: Sequence[float], drift: ProbeDrift,
           max_drift: float = MAX_DRIFT) -> BucketDecision:
    """Keep the compiled graph iff it is faster beyond the noise and does not drift."""
    raw_ms, comp_ms = statistics.median(raw), statistics.median(compiled)
    noise = max(noise_ms(raw), noise_ms(compiled))
    if drift.top1_agreement < 1.0 or drift.max_rel_err > max_drift:
        reason = f"drifts (top-1 {drift.top1_agreement:.3f}, rel err {drift.max_rel_err:.1e} > {max_drift:.0e})"
        return BucketDecision(size, False, raw_ms, comp_ms, noise, drift, reason)
    if raw_ms - comp_ms <= noise:
        reason = f"not faster beyond noise ({comp_ms:.3f} vs {raw_ms:.3f} ms, noise {noise:.3f} ms)"
        return BucketDecision(size, False, raw_ms, comp_ms, noise, drift, reason)
    return BucketDecision(size, True, raw_ms, comp_ms, noise, drift, f"{raw_ms / comp_ms:.2f}x faster")


def decision_table(decisions: Sequence[BucketDecision]) -> str:
    """The start-up table: one line per bucket."""
    lines = [f"{'bucket':>6} {'graph ms':>9} {'compiled ms':>11} {'speed-up':>8}  {'choice':<8} reason"]
    for d in sorted(decisions, key=lambda d: d.size):
        choice = "compiled" if d.use_compiled else "graph"
        lines.append(f"{d.size:>6} {d.raw_ms:>9.3f} {d.compiled_ms:>11.3f} {d.speedup:>7.2f}x  {choice:<8} {d.reason}")
    return "\n".join(lines)
