"""Programmatic dependent launch (sm_90+), a sweep knob that is off by default.

A kernel launched with ``launch_pdl=True`` may be scheduled while the kernel
before it in the stream is still finishing, so its launch and set-up overlap
that tail instead of following it (the gap between two graph nodes at batch 1
is about 0.45 us on the H200, 149 times per 1.5B step). Safety: such a kernel
calls ``wait_for_previous`` before its first global memory access, which blocks
until the previous grid has completed and its writes are visible; so it also
completes after it, and the guarantee chains along the stream.

Turned on per module by ``CONFIG_OVERRIDE["pdl"] = True`` (skinny_gemm,
decode_attention) for ``benchmarks/batch1.py``; never in the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ingot.ops.triton._common import interpreting


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """With PDL: wait for the previous kernel, then let the next one be scheduled."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_args(override: dict) -> dict:
    """The kernel's ``PDL`` constexpr and, when on, the ``launch_pdl`` launch keyword
    (Triton before 3.4 has none); on only by ``override["pdl"]``, never in the interpreter."""
    on = bool(override.get("pdl", False)) and not interpreting()
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
