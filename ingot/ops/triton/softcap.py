"""Attention logits in the kernels' base-2 units, with Gemma 2's optional soft-cap, and the
softmax's denominator with gpt-oss's optional attention sinks.

One helper each for the decode and prefill kernels, so both cap exactly as the reference
does: ``cap * tanh(q.k * scale / cap)``, computed as ``2 * sigmoid(2x) - 1`` (Triton's
core language has no tanh on every backend, its interpreter included); a sink is one more
logit per head that joins only the denominator, so it is added once, at the end, to the
online softmax's sum (``exp(sink - max)``): the loops over keys are unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def scaled_logits(s, scale_log2, cap_log2, SOFTCAP: tl.constexpr):
    """Raw q.k sums -> logits times log2(e): ``s * scale``, or soft-capped at ``cap``
    (``cap_log2`` = cap * log2(e)) when SOFTCAP."""
    if SOFTCAP:
        x = s * (scale_log2 / cap_log2)
        return (2.0 * tl.sigmoid(2.0 * x) - 1.0) * cap_log2
    else:
        return s * scale_log2


@triton.jit
def softmax_denominator(l, m, sinks_ptr, idx, mask, HAS_SINKS: tl.constexpr):
    """The denominator of an online softmax whose sum is ``l`` relative to the base-2 max ``m``:
    with HAS_SINKS plus ``exp2(sink * log2(e) - m)``, the head's sink (``sinks_ptr + idx``, a
    raw logit); 1 where it is 0 (no visible key and no sink: the output is 0)."""
    if HAS_SINKS:
        if mask is None:
            sink = tl.load(sinks_ptr + idx).to(tl.float32) * 1.4426950408889634
        else:
            sink = tl.load(sinks_ptr + idx, mask=mask, other=0.0).to(tl.float32) * 1.4426950408889634
        l = l + tl.exp2(sink - tl.where(m == float("-inf"), 0.0, m))
    return tl.where(l > 0.0, l, 1.0)
