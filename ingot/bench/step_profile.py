"""Where a decode step spends its GPU time: its kernels per step, grouped by family.

``ingot bench decode --profile`` runs a few replays of each bucket's captured
graph under ``torch.profiler`` and sums the kernels' GPU time per step. The
back-to-back step's time minus that sum is the time between kernels (gaps
between graph nodes); a step timed alone adds the host's share (the input
copies and the graph launch, with the device idle).

Every decoder layer launches the same kernels in the same order, so one
replay's launch sequence folds into one layer (``fold_layers``): each
kernel's place in the layer, with the time from the end of the kernel before
it to its own end (gaps included, so the places add up to the layer), median
over the layers and replays. That separates kernels a family lumps together
(the q/k/v and the o projections are both skinny GEMMs).
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

# substrings of cuBLAS / CUTLASS GEMM kernel names: they share one label
_GEMM_MARKERS = ("gemm", "gemv", "cutlass", "sm90", "nvjet")


def kernel_family(name: str) -> str:
    """A kernel's label: "GEMM" for library GEMMs, else its (shortened) name."""
    low = name.lower()
    return "GEMM" if any(m in low for m in _GEMM_MARKERS) else name[:60]


@dataclass
class StepProfile:
    """Per step: (family, launches, GPU us) rows, heaviest first; and one decoder layer's
    kernels in launch order, (name, us from the previous kernel's end to its end, its own
    GPU us), when the step's launches fold into its layers."""

    kernels: list[tuple[str, float, float]] = field(default_factory=list)
    layer: list[tuple[str, float, float]] = field(default_factory=list)

    @property
    def kernel_us(self) -> float:
        return sum(us for _, _, us in self.kernels)

    @property
    def launches(self) -> float:
        return sum(n for _, n, _ in self.kernels)


def _layer_period(names: Sequence[str], num_layers: int) -> Optional[tuple[int, int]]:
    """(first index, kernels a layer) of the shortest run of ``num_layers`` identical
    launch sequences in ``names``, the earliest such run; None when there is none (layers
    that differ, as in models with dense and sparse layers)."""
    n = len(names)
    for period in range(1, n // num_layers + 1):
        span = period * num_layers
        for start in range(n - span + 1):
            if all(names[i] == names[i + period] for i in range(start, start + span - period)):
                return start, period
    return None


def fold_layers(replays: Sequence[Sequence[tuple[str, float, float]]], num_layers: int) -> list[tuple[str, float, float]]:
    """One decoder layer's kernels from replays of a step, each a list of (name, start us,
    end us) in launch order: per place in the layer, its name, the median over layers and
    replays of the time from the previous kernel's end to its end, and the median of its
    own duration. Empty when the launches do not fold into ``num_layers`` equal layers."""
    if not replays or num_layers < 1:
        return []
    names = [name for name, _, _ in replays[0]]
    found = _layer_period(names, num_layers)
    if found is None:
        return []
    start, period = found
    spans: list[list[float]] = [[] for _ in range(period)]
    own: list[list[float]] = [[] for _ in range(period)]
    for events in replays:
        if [name for name, _, _ in events] != names:
            continue  # a replay that launched otherwise (profiler hiccup): left out
        for layer in range(num_layers):
            for j in range(period):
                i = start + layer * period + j
                _, begin, end = events[i]
                prev_end = events[i - 1][2] if i > 0 else begin
                spans[j].append(end - prev_end)
                own[j].append(end - begin)
    return [(names[start + j], statistics.median(spans[j]), statistics.median(own[j])) for j in range(period) if spans[j]]


@torch.inference_mode()
def profile_step(step: Callable[[], object], steps: int = 10, num_layers: int = 0) -> StepProfile:
    """Kernel launches and GPU time per call of ``step`` (a CUDA graph replay), averaged over
    ``steps`` calls; with ``num_layers``, also one layer's kernels (``fold_layers``)."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    timeline = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[kernel_family(ev.name)]
            entry[0] += 1
            entry[1] += ev.device_time_total
            timeline.append((ev.name, ev.time_range.start, ev.time_range.end))
    rows = sorted(((k, n / steps, us / steps) for k, (n, us) in totals.items()), key=lambda r: -r[2])
    timeline.sort(key=lambda e: e[1])
    per_replay = len(timeline) // steps
    replays = [timeline[r * per_replay:(r + 1) * per_replay] for r in range(steps)] if per_replay * steps == len(timeline) else []
    return StepProfile(rows, fold_layers(replays, num_layers) if num_layers else [])
