"""Where a decode step spends its GPU time: its kernels per step, grouped by family.

``ingot bench decode --profile`` runs a few replays of each bucket's captured
graph under ``torch.profiler`` and sums the kernels' GPU time per step. The
back-to-back step's time minus that sum is the time between kernels (gaps
between graph nodes); a step timed alone adds the host's share (the input
copies and the graph launch, with the device idle).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable

import torch

# substrings of cuBLAS / CUTLASS GEMM kernel names: they share one label
_GEMM_MARKERS = ("gemm", "gemv", "cutlass", "sm90", "nvjet")


def kernel_family(name: str) -> str:
    """A kernel's label: "GEMM" for library GEMMs, else its (shortened) name."""
    low = name.lower()
    return "GEMM" if any(m in low for m in _GEMM_MARKERS) else name[:60]


@dataclass
class StepProfile:
    """Per step: (family, launches, GPU us) rows, heaviest first."""

    kernels: list[tuple[str, float, float]] = field(default_factory=list)

    @property
    def kernel_us(self) -> float:
        return sum(us for _, _, us in self.kernels)

    @property
    def launches(self) -> float:
        return sum(n for _, n, _ in self.kernels)


@torch.inference_mode()
def profile_step(step: Callable[[], object], steps: int = 10) -> StepProfile:
    """Kernel launches and GPU time per call of ``step`` (a CUDA graph replay), averaged over ``steps`` calls."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[kernel_family(ev.name)]
            entry[0] += 1
            entry[1] += ev.device_time_total
    rows = sorted(((k, n / steps, us / steps) for k, (n, us) in totals.items()), key=lambda r: -r[2])
    return StepProfile(rows)
