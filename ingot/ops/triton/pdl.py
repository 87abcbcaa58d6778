"""Programmatic dependent launch (PDL) for the decode-step kernels.

Inside a captured decode step, each kernel boundary costs more than a launch: the
next kernel's programs start only once the last program of the previous one has
finished and its writes are flushed, so the GPU idles through the previous kernel's
tail (split-K merges, epilogues, the last slices of attention) and the next one's
ramp. At batch 1 a Qwen3-30B-A3B layer is six kernels of a few microseconds each.

With PDL (sm_90+), a kernel launched with ``launch_pdl=True`` may start while its
predecessor still runs, once every program of the predecessor has called
``release_dependents`` (or exited); it calls ``wait_for_producer`` before its first
read of anything a kernel writes (activations, the KV cache, split counters, the
routing), which returns when the predecessor has completed and its writes are
visible. Kernels launched without PDL are ordered as usual, so a PDL kernel may
follow or precede any other kernel. Since every PDL kernel releases only after its
own wait, a kernel two launches back has completed when a successor starts: what
it (or the host) wrote may be read before the wait. Compiled decode launches
Inductor's kernels with PDL under the same contract (``triton.enable_pdl``).

Where it pays: the batch-1 chain of skinny GEMVs, decode attention and per-pair fused
MoE, each releasing its successor after its main loop, so the successor is resident and
waiting while the split-K merges, slice merges and token sums run. Graph steps of the
Qwen3-30B-A3B shape back to back take 0.966x the time without it, compiled 0.986x;
Qwen2.5-1.5B 0.94-0.98x. Slower, and so not done: releasing at a kernel's start (the
waiting successor's programs take SM slots the running kernel still needs: 1.08x the graph
step), PDL on kernels whose neighbours run without it (the GEMVs alone: 1.015x; attention
between cuBLAS GEMMs at batch 64: 1.006-1.010x), prefetching weights into L2 before the
wait (1.05-1.09x: the prefetch competes with the running kernel's own reads), and loading
a first weight or K/V tile into registers there (1.00-1.07x). So the attention and MoE
kernels take it only on their few-row paths, and only decode attention's metadata loads
before its wait (0.992x).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ingot.ops.triton._common import capability, interpreting


# grid dependency control in this Triton (3.3+); read once, as every launch asks
_TRITON_HAS_GDC = all(hasattr(getattr(tl.extra, "cuda", None), name) for name in ("gdc_wait", "gdc_launch_dependents"))


def pdl_supported(device: torch.device) -> bool:
    """PDL needs an sm_90+ GPU and a Triton with grid dependency control (3.3+)."""
    return _TRITON_HAS_GDC and not interpreting() and capability(device) >= (9, 0)


@triton.jit
def wait_for_producer(PDL: tl.constexpr):
    """Block until the kernel this one depends on has completed and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_dependents(PDL: tl.constexpr):
    """Let the next PDL kernel start once every program of this one has called this (or exited)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


__all__ = ["pdl_supported", "wait_for_producer", "release_dependents"]
