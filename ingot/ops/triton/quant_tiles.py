"""Quantized weight tiles made dot operands in registers (quant_gemm.py's kernels, fused_moe_quant.py's).

Element conversions: int4 / int8 words to ``2**23 + u`` in fp32 (``unpack``: the value's byte
under the exponent bits 0x4B, one ``prmt`` a value), float8 e4m3 to fp32 (``e4m3_to_f32``).

``tile_sums``, the K loop of the tensor-core paths where each K tile lies in one group of W:
the dot on exact values (``u - zero``; fp8 values), its sums scaled per tile (once at the end
where one group spans K), so weights are never rounded. Rows past M and N read the last row
(never stored) and full K tiles read unmasked (``EVEN_K``); the scales (zeros, mins, W8A8
activation scales) load a tile ahead, which hides their latency (the pipeliner only
prefetches what a dot reads).

int4 without float work per weight: a nibble u under a 16-bit float's exponent is exactly
``OFFSET + u`` (bf16 bits ``0x4300 | u`` are 128 + u, fp16 ``0x6400 | u`` 1024 + u). One
``prmt`` puts two nibbles (each alone in its byte after a mask) under the exponent byte, a
register of two values: a word of eight weights costs two masks, a shift and four prmts, then
one packed subtraction of ``OFFSET + zero`` per register leaves ``u - zero``, exact. prmt pairs
the low nibbles of bytes 0 and 1 (values 0 and 2 of the word), so the tile's columns are in
the pairs' order, of each 8 (a word) the four low nibbles' then the four high nibbles'. A dot
does not care how K is ordered as long as x's columns follow (``permute_k``): x is small and
shared by the tile's rows, and Triton's mma layouts with 8 values a thread (``kWidth = 8``,
which the 8-bit load in the operand's chain selects) take the pairs as unpacked. Where x is
a wgmma operand read from shared memory (64 rows) the pairs are regrouped in column order
instead (a prmt per two weights). Without ``PRMT`` (the interpreter) the same values by shifts.
"""

from __future__ import annotations

import triton
import triton.language as tl

PRMT4 = tl.constexpr("{ .reg .b32 lo, hi; and.b32 lo, $8, 0x0F0F0F0F; shr.u32 hi, $8, 4; and.b32 hi, hi, 0x0F0F0F0F; "
         + " ".join(f"prmt.b32 ${2 * i}, lo, 0x4B000000, {0x7650 + i}; prmt.b32 ${2 * i + 1}, hi, 0x4B000000, {0x7650 + i};"
                    for i in range(4)) + " }")
PRMT8 = tl.constexpr("{ " + " ".join(f"prmt.b32 ${i}, $4, 0x4B000000, {0x7650 + i};" for i in range(4)) + " }")


def _offset4_asm(magic: int) -> str:
    """PTX: four bytes of int4 values (one int32 word, values 0..7 from the low nibble up) ->
    16-bit floats ``magic byte << 8 | value``: the low nibbles' values 0 2 | 4 6 in $0 | $1,
    the high nibbles' 1 3 | 5 7 in $2 | $3 (two a register, the first in the low half)."""
    return ("{ .reg .b32 lo, hi; and.b32 lo, $4, 0x0F0F0F0F; shr.u32 hi, $4, 4; and.b32 hi, hi, 0x0F0F0F0F; "
            f"prmt.b32 $0, lo, {magic:#x}, 0x5140; prmt.b32 $1, lo, {magic:#x}, 0x7362; "
            f"prmt.b32 $2, hi, {magic:#x}, 0x5140; prmt.b32 $3, hi, {magic:#x}, 0x7362; }}")


OFFSET4_BF16 = tl.constexpr(_offset4_asm(0x43434343))  # bf16 0x4300 | u = 128 + u
OFFSET4_FP16 = tl.constexpr(_offset4_asm(0x64646464))  # fp16 0x6400 | u = 1024 + u


@triton.jit
def _interleave(e0, e1, e2, e3, e4, e5, e6, e7, BITS: tl.constexpr):
    """The values of a word's elements (``e_j``: element j of each word, [..., W]) -> [..., W, 2, 2(, 2)],
    in little-endian order once the trailing dims are merged (element 4p + 2q + c at [p, q, c])."""
    if BITS == 4:
        return tl.join(tl.join(tl.join(e0, e4), tl.join(e2, e6)), tl.join(tl.join(e1, e5), tl.join(e3, e7)))
    else:
        return tl.join(tl.join(e0, e2), tl.join(e1, e3))


@triton.jit
def unpack(words, BITS: tl.constexpr, PRMT: tl.constexpr):
    """int32 words [..., W] -> ``2**23 + u`` in fp32 for each value u, [..., W, 2, 2(, 2)] (``_interleave``).
    On a GPU each value is one ``prmt`` (its byte under the exponent bits 0x4B), after three
    ops per int4 word that put the even and odd nibbles in bytes. Without ``PRMT`` (the
    interpreter runs no inline asm) by shifts and masks."""
    if not PRMT:
        if BITS == 4:
            t = _interleave(words & 0xF, (words >> 4) & 0xF, (words >> 8) & 0xF, (words >> 12) & 0xF,
                            (words >> 16) & 0xF, (words >> 20) & 0xF, (words >> 24) & 0xF, (words >> 28) & 0xF, BITS)
        else:
            t = _interleave(words & 0xFF, (words >> 8) & 0xFF, (words >> 16) & 0xFF, (words >> 24) & 0xFF,
                            words, words, words, words, BITS)
        return (t | 0x4B000000).to(tl.float32, bitcast=True)
    else:
        if BITS == 4:
            e = tl.inline_asm_elementwise(PRMT4, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words], dtype=(tl.float32,) * 8,
                                          is_pure=True, pack=1)
            return _interleave(e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7], BITS)
        else:
            e = tl.inline_asm_elementwise(PRMT8, "=r,=r,=r,=r,r", [words], dtype=(tl.float32,) * 4, is_pure=True, pack=1)
            return _interleave(e[0], e[1], e[2], e[3], e[0], e[0], e[0], e[0], BITS)


@triton.jit
def e4m3_to_f32(raw, NATIVE: tl.constexpr):
    """float8 e4m3fn (fp8 values, or their bytes without ``NATIVE``) -> fp32. By bits: sign,
    exponent and mantissa moved under fp32's, then scaled by 2**120 (the exponent biases'
    difference); e4m3 subnormals land on fp32 subnormals, which that product scales exactly."""
    if NATIVE:
        return raw.to(tl.float32)
    else:
        b = raw.to(tl.uint32)
        bits = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
        return bits.to(tl.float32, bitcast=True) * 1.329227995784916e36


@triton.jit
def act_in(x, dtype: tl.constexpr, ACT_Q: tl.constexpr, NATIVE: tl.constexpr):
    """An activation tile in ``dtype``: fp8 activations (``ACT_Q``) exactly, by value."""
    if ACT_Q:
        return e4m3_to_f32(x, NATIVE).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def dot(acc, a, b, DOT_F32: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b.T; fp32 operands in IEEE precision (``IEEE``), the interpreter's in fp32."""
    if DOT_F32:  # the interpreter's dot mishandles 16-bit and fp8 operands
        return acc + tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
    elif IEEE:
        return tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    else:
        return tl.dot(a, tl.trans(b), acc)


@triton.jit
def offset_values(raw, BF16: tl.constexpr, PRMT: tl.constexpr, NATURAL: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """int4 weights as bytes [BLOCK_N, BLOCK_K / 2] (two values a byte, the low nibble first) ->
    ``OFFSET + u`` in bf16 (``BF16``) or fp16, [BLOCK_N, BLOCK_K]: columns in ``permute_k``'s
    order, or with ``NATURAL`` in order."""
    if PRMT:
        if BF16:
            lo, hi = tl.inline_asm_elementwise(OFFSET4_BF16, "=r,=r,=r,=r,r", [raw], dtype=(tl.bfloat16, tl.bfloat16),
                                               is_pure=True, pack=4)
        else:
            lo, hi = tl.inline_asm_elementwise(OFFSET4_FP16, "=r,=r,=r,=r,r", [raw], dtype=(tl.float16, tl.float16),
                                               is_pure=True, pack=4)
    else:
        offset: tl.constexpr = 128.0 if BF16 else 1024.0
        dtype: tl.constexpr = tl.bfloat16 if BF16 else tl.float16
        b = raw.to(tl.int32) & 0xFF
        lo = ((b & 0xF).to(tl.float32) + offset).to(dtype)
        hi = ((b >> 4).to(tl.float32) + offset).to(dtype)
    if NATURAL:  # columns in order: the pairs regrouped (a prmt per two values)
        return tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
    pairs = tl.join(tl.reshape(lo, (BLOCK_N, BLOCK_K // 8, 4)), tl.reshape(hi, (BLOCK_N, BLOCK_K // 8, 4)))
    return tl.reshape(tl.permute(pairs, (0, 1, 3, 2)), (BLOCK_N, BLOCK_K))


@triton.jit
def permute_k(x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] with its columns in ``offset_values``' order (column 8w + 2b + h at 8w + 4h + b)."""
    return tl.reshape(tl.permute(tl.reshape(x, (BLOCK_M, BLOCK_K // 8, 4, 2)), (0, 1, 3, 2)), (BLOCK_M, BLOCK_K))


@triton.jit
def group_params(s_rows, z_rows, mn_rows, g, zero_point, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr):
    """The scales, zeros and mins (fp32) of group ``g`` of the rows whose first group is at ``s_rows``
    (``z_rows``, ``mn_rows``)."""
    scale = tl.load(s_rows + g).to(tl.float32)
    zero = scale * 0.0 + zero_point  # from the scales, in their layout (a constant splat's cost 20% more instructions)
    if HAS_ZEROS:
        zero = tl.load(z_rows + g).to(tl.float32)
    mins = scale * 0.0
    if HAS_MINS:
        mins = tl.load(mn_rows + g).to(tl.float32)
    return scale, zero, mins


@triton.jit
def tile_dot(
    x, w_rows, zero, k0, K, FP8: tl.constexpr, BITS: tl.constexpr, FP8_NATIVE: tl.constexpr, PRMT: tl.constexpr,
    ACT_Q: tl.constexpr, FP8_DOT: tl.constexpr, DOT_F32: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, dtype: tl.constexpr,
):
    """x . W[:, k0 : k0 + BLOCK_K] in fp32, [BLOCK_M, BLOCK_N], on W's exact values (``u - zero``, fp8
    values): x [BLOCK_M, BLOCK_K] (columns past K zero; fp8 with ``ACT_Q``), W's rows at ``w_rows``
    (fp8: element pointers; int8: int32 words; int4: int8 pointers, two values a byte)."""
    BLOCK_M: tl.constexpr = x.shape[0]
    if FP8 or BITS == 4:
        WIDTH: tl.constexpr = BLOCK_K if FP8 else BLOCK_K // 2
    else:
        WIDTH: tl.constexpr = BLOCK_K // 4
    kw = (k0 // BLOCK_K) * WIDTH + tl.arange(0, WIDTH)  # a multiple of WIDTH: the loads vectorize
    if EVEN_K:
        raw = tl.load(w_rows[:, None] + kw[None, :])
    else:
        raw = tl.load(w_rows[:, None] + kw[None, :], mask=(kw < K * WIDTH // BLOCK_K)[None, :],
                      other=0.0 if FP8 else 0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FP8:
        if FP8_DOT:  # fp8 tensor cores: W8A8's fp8 activations times the raw tile
            return dot(acc, x, raw, DOT_F32, False)
        return dot(acc, act_in(x, dtype, ACT_Q, FP8_NATIVE), e4m3_to_f32(raw, FP8_NATIVE).to(dtype), DOT_F32, False)
    elif BITS == 8:
        u = tl.reshape(unpack(raw, 8, PRMT), (BLOCK_N, BLOCK_K))  # 2**23 + u
        return dot(acc, x, (u - (zero + 8388608.0)[:, None]).to(dtype), DOT_F32, False)
    else:
        NATURAL: tl.constexpr = BLOCK_M >= 64  # wgmma: x read from shared memory as loaded
        values = offset_values(raw, dtype == tl.bfloat16, PRMT, NATURAL, BLOCK_N, BLOCK_K)
        offset_zero = zero + (128.0 if dtype == tl.bfloat16 else 1024.0)
        if PRMT:  # one packed subtraction per two weights: u - zero, exact
            values = values - offset_zero.to(dtype)[:, None]
        else:  # the interpreter holds 16-bit floats as their bits: the same values through fp32
            values = (values.to(tl.float32) - offset_zero[:, None]).to(dtype)
        if not NATURAL:
            x = permute_k(x, BLOCK_M, BLOCK_K)
        return dot(acc, x, values, DOT_F32, False)


@triton.jit
def tile_sums(
    acc, x_ptr, xs_ptr, w_ptr, s_ptr, z_ptr, mn_ptr, offs_m, offs_n, M, N, K, k_lo, k_hi, stride_xm, stride_wn,
    stride_sn, zero_point, scale_bn, group_shift, act_shift, n_act, FP8: tl.constexpr, BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr, FP8_NATIVE: tl.constexpr, PRMT: tl.constexpr, ACT_Q: tl.constexpr,
    GROUPED_ACT: tl.constexpr, FP8_DOT: tl.constexpr, DOT_F32: tl.constexpr, EVEN_K: tl.constexpr,
    ONE_GROUP: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr,
):
    """acc [BLOCK_M, BLOCK_N] + x[offs_m, k_lo:k_hi] . W[offs_n, k_lo:k_hi]: W's scale (zero, min)
    per ``scale_bn`` rows and group of ``1 << group_shift`` columns (``ONE_GROUP``: one spans K),
    x's W8A8 scales per row and ``1 << act_shift`` columns (``GROUPED_ACT``; per token: the caller's),
    K tiles of ``BLOCK_K`` in one group of each; ``dtype`` the dots' 16-bit type."""
    BLOCK_N: tl.constexpr = acc.shape[1]
    rows = tl.minimum(offs_n, N - 1)
    if FP8:
        w_rows = w_ptr + rows.to(tl.int64) * stride_wn
    elif BITS == 4:
        w_rows = w_ptr.to(tl.pointer_type(tl.int8)) + rows.to(tl.int64) * (stride_wn * 4)
    else:
        w_rows = w_ptr + rows.to(tl.int64) * stride_wn
    s_rows = (rows // scale_bn) * stride_sn
    x_row = tl.minimum(offs_m, M - 1)
    x_rows = x_ptr + x_row[:, None] * stride_xm
    scale, zero, mins = group_params(s_ptr + s_rows, z_ptr + s_rows, mn_ptr + s_rows, k_lo >> group_shift, zero_point,
                                     HAS_ZEROS, HAS_MINS)
    x_scale = tl.zeros([acc.shape[0]], dtype=tl.float32)
    if GROUPED_ACT:
        x_scale = tl.load(xs_ptr + x_row * n_act + (k_lo >> act_shift))
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_rows + offs_k[None, :])
        else:
            x = tl.load(x_rows + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)
        k_next = tl.minimum(k0 + BLOCK_K, K - 1)  # the next tile's column (at the end the last tile's)
        next_scale, next_zero, next_mins = scale, zero, mins
        if not ONE_GROUP:
            next_scale, next_zero, next_mins = group_params(s_ptr + s_rows, z_ptr + s_rows, mn_ptr + s_rows,
                                                            k_next >> group_shift, zero_point, HAS_ZEROS, HAS_MINS)
        next_x_scale = x_scale
        if GROUPED_ACT:
            next_x_scale = tl.load(xs_ptr + x_row * n_act + (k_next >> act_shift))
        part = tile_dot(x, w_rows, zero, k0, K, FP8, BITS, FP8_NATIVE, PRMT, ACT_Q, FP8_DOT, DOT_F32, EVEN_K, BLOCK_N,
                        BLOCK_K, dtype)
        if GROUPED_ACT:
            part *= x_scale[:, None]
        if ONE_GROUP:
            acc += part
        else:
            acc += part * scale[None, :]
            if HAS_MINS:  # GGUF's u * scale + min: the rows' sums of x times the mins
                acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * mins[None, :]
        scale, zero, mins, x_scale = next_scale, next_zero, next_mins, next_x_scale
    if ONE_GROUP:
        acc *= scale[None, :]
    return acc


__all__ = ["unpack", "e4m3_to_f32", "act_in", "dot", "offset_values", "permute_k", "group_params", "tile_dot",
           "tile_sums"]
