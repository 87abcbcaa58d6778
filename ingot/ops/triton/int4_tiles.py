"""int4 weight tiles for tensor-core dots with no float op per weight before the dot
(quant_gemm.py's GEMV and GEMM, where a K tile lies in one group).

A nibble u under a 16-bit float's exponent is exactly ``OFFSET + u``: bf16 bits ``0x4300 | u``
are 128 + u, fp16 bits ``0x6400 | u`` 1024 + u. One ``prmt`` puts two nibbles (each alone in
its byte after a mask) under the exponent byte 0x43 (0x64), making a register of two values,
so a word of eight weights costs two masks, a shift and four prmts; one packed subtraction
of ``OFFSET + zero`` per register leaves ``u - zero``, exact in the 16-bit type; the tile is
dotted with x and the sums scaled per tile (the K tile lies in one group; fp32, so the
weights are never rounded: more exact than rounding ``(u - zero) * scale`` to bf16 first).

prmt pairs the low nibbles of bytes 0 and 1 (values 0 and 2 of the word), so the tile's
columns are in the order of the pairs: of each 8 columns (one word), the four low nibbles'
(0, 2, 4, 6) first, then the four high nibbles'. A dot does not care how K is ordered as long
as x's columns follow the same order (``permute_k``): x is small and shared by all the
tile's rows, and Triton's dot layouts with 8 values a thread (``kWidth = 8``, which an 8-bit
load in the operand's chain selects) take the pairs as unpacked, with no shuffle.
Without ``PRMT`` (the interpreter) the same values by shifts and masks.
"""

from __future__ import annotations

import triton
import triton.language as tl


def _offset4_asm(magic: int) -> str:
    """PTX: four bytes of int4 values (one int32 word, values 0..7 from the low nibble up) ->
    16-bit floats ``magic byte << 8 | value``: the low nibbles' values 0 2 | 4 6 in $0 | $1,
    the high nibbles' 1 3 | 5 7 in $2 | $3 (two a register, the first in the low half)."""
    return ("{ .reg .b32 lo, hi; and.b32 lo, $4, 0x0F0F0F0F; shr.u32 hi, $4, 4; and.b32 hi, hi, 0x0F0F0F0F; "
            f"prmt.b32 $0, lo, {magic:#x}, 0x5140; prmt.b32 $1, lo, {magic:#x}, 0x7362; "
            f"prmt.b32 $2, hi, {magic:#x}, 0x5140; prmt.b32 $3, hi, {magic:#x}, 0x7362; }}")


_OFFSET4_BF16 = tl.constexpr(_offset4_asm(0x43434343))  # bf16 0x4300 | u = 128 + u
_OFFSET4_FP16 = tl.constexpr(_offset4_asm(0x64646464))  # fp16 0x6400 | u = 1024 + u


def offset_of(bf16: bool) -> float:
    """The value of a 16-bit float's magic bits with a zero nibble under them (bf16 128, fp16 1024)."""
    return 128.0 if bf16 else 1024.0


@triton.jit
def offset_values(raw, BF16: tl.constexpr, PRMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """int4 weights as bytes [BLOCK_N, BLOCK_K / 2] (two values a byte, the low nibble first) ->
    ``OFFSET + u`` in bf16 (``BF16``) or fp16, [BLOCK_N, BLOCK_K] with columns in ``permute_k``'s order."""
    if PRMT:
        if BF16:
            lo, hi = tl.inline_asm_elementwise(_OFFSET4_BF16, "=r,=r,=r,=r,r", [raw], dtype=(tl.bfloat16, tl.bfloat16),
                                               is_pure=True, pack=4)
        else:
            lo, hi = tl.inline_asm_elementwise(_OFFSET4_FP16, "=r,=r,=r,=r,r", [raw], dtype=(tl.float16, tl.float16),
                                               is_pure=True, pack=4)
    else:
        offset: tl.constexpr = 128.0 if BF16 else 1024.0
        dtype: tl.constexpr = tl.bfloat16 if BF16 else tl.float16
        b = raw.to(tl.int32) & 0xFF
        lo = ((b & 0xF).to(tl.float32) + offset).to(dtype)
        hi = ((b >> 4).to(tl.float32) + offset).to(dtype)
    pairs = tl.join(tl.reshape(lo, (BLOCK_N, BLOCK_K // 8, 4)), tl.reshape(hi, (BLOCK_N, BLOCK_K // 8, 4)))
    return tl.reshape(tl.permute(pairs, (0, 1, 3, 2)), (BLOCK_N, BLOCK_K))


@triton.jit
def permute_k(x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] with its columns in ``offset_values``' order (column 8w + 2b + h at 8w + 4h + b)."""
    return tl.reshape(tl.permute(tl.reshape(x, (BLOCK_M, BLOCK_K // 8, 4, 2)), (0, 1, 3, 2)), (BLOCK_M, BLOCK_K))


@triton.jit
def group_params(s_rows, z_rows, mn_rows, g, zero_point, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr):
    """The scales, zeros and mins [BLOCK_N] (fp32) of group ``g`` of the rows whose first group is at
    ``s_rows`` (``z_rows``, ``mn_rows``): loaded a tile ahead by the loops, which hides their latency
    (the pipeliner only prefetches the tiles a dot reads)."""
    scale = tl.load(s_rows + g).to(tl.float32)
    zero = scale * 0.0 + zero_point
    if HAS_ZEROS:
        zero = tl.load(z_rows + g).to(tl.float32)
    mins = scale * 0.0
    if HAS_MINS:
        mins = tl.load(mn_rows + g).to(tl.float32)
    return scale, zero, mins


@triton.jit
def int4_tile_dot(
    acc, x, w_rows, scale, zero, mins, k0, K, PRMT: tl.constexpr, DOT_F32: tl.constexpr, HAS_MINS: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """acc + x . W[:, k0 : k0 + BLOCK_K] for x [BLOCK_M, BLOCK_K] (bf16 or fp16, columns past K zero)
    and an int4 W whose rows' bytes start at ``w_rows`` [BLOCK_N] (int8 pointers), the tile in one
    group of ``scale``, ``zero``, ``mins`` (``group_params``)."""
    BF16: tl.constexpr = x.dtype == tl.bfloat16
    BLOCK_M: tl.constexpr = x.shape[0]
    kb = (k0 // BLOCK_K) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    if EVEN_K:
        raw = tl.load(w_rows[:, None] + kb[None, :])
    else:
        raw = tl.load(w_rows[:, None] + kb[None, :], mask=(kb < K // 2)[None, :], other=0)
    values = offset_values(raw, BF16, PRMT, BLOCK_N, BLOCK_K)
    offset_zero = zero + (128.0 if BF16 else 1024.0)
    if PRMT:  # one packed subtraction per two weights: u - zero, exact
        values = values - offset_zero.to(x.dtype)[:, None]
    else:  # the interpreter holds 16-bit floats as their bits: the same values through fp32
        values = (values.to(tl.float32) - offset_zero[:, None]).to(x.dtype)
    x = permute_k(x, BLOCK_M, BLOCK_K)
    if DOT_F32:  # the interpreter's dot mishandles 16-bit operands
        part = tl.dot(x.to(tl.float32), tl.trans(values.to(tl.float32)))
    else:
        part = tl.dot(x, tl.trans(values))
    acc += part * scale[None, :]
    if HAS_MINS:  # GGUF's u * scale + min: the rows' sums of x times the mins
        acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * mins[None, :]
    return acc


__all__ = ["offset_values", "permute_k", "group_params", "int4_tile_dot", "offset_of"]
