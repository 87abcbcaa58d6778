"""fp32 rounded to the model dtype inside a kernel, kept in fp32: what one torch op in
that dtype yields. The kernels that must match the reference ops bit for bit
(rotary, the prologues of the skinny GEMM) round every intermediate this way.

Not ``x.to(bf16).to(fp32)``: compiled for the GPU, that round trip does not round
rotary's products the way eager does (1-ulp differences in 19% of elements; products
of bf16 values are exact in fp32, so only a skipped rounding explains them), and the
interpreter's cast truncates. Two forms no compiler pass can fold away:

* ``rne_bf16``: integer ops (about five per value); what the interpreter runs.
* ``round_pair``: ``cvt.rn.bf16x2.f32`` in inline asm (sm_80+), two values per
  instruction plus two bit ops; GPU only. Rotary runs it (on the integer form
  it would be compute-bound); the skinny GEMM's prologues keep ``round_to``, where
  ``cvt`` is slower.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ingot.ops.triton._common import interpreting

# the interpreter runs no inline asm
INTERPRET = tl.constexpr(interpreting())


@triton.jit
def rne_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32, by integer ops."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to(x, dtype: tl.constexpr, BF16: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (bf16: ``rne_bf16``), kept in fp32."""
    if BF16:
        return rne_bf16(x)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def round_pair(x, y, dtype: tl.constexpr, BF16: tl.constexpr):
    """``round_to`` of two fp32 tensors of one shape; bf16 on a GPU through one
    ``cvt.rn.bf16x2.f32`` per pair of elements (about a third of ``rne_bf16``'s ops)."""
    if BF16 and not INTERPRET:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 p; cvt.rn.bf16x2.f32 p, $2, $3; and.b32 $0, p, 0xFFFF0000; shl.b32 $1, p, 16; }",
            "=r,=r,r,r", [x, y], dtype=(tl.float32, tl.float32), is_pure=True, pack=1,
        )
    else:
        return round_to(x, dtype, BF16), round_to(y, dtype, BF16)

