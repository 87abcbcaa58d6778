"""Attention logits in the kernels' base-2 units, with Gemma 2's optional soft-cap.

One helper for the decode and prefill kernels, so both cap exactly as the reference
does: ``cap * tanh(q.k * scale / cap)``, computed as ``2 * sigmoid(2x) - 1`` (Triton's
core language has no tanh on every backend, its interpreter included).
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
