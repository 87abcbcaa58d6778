"""Neox-style rotary embedding on q [T, Hq, D] and k [T, Hkv, D] into fresh outputs.

``cos_sin_cache`` is ``[max_pos, D]``: cos in the first D/2 columns, sin in the
last D/2. Numerics follow ``reference.rotary_embedding`` under torch: the table
is cast to the activation dtype, and each of ``x * cos``, ``rotate_half(x) *
sin`` and their sum is rounded to that dtype (so bf16 results match torch's).

Each program rotates a tile of rows, a row being one head of one token; q heads
and k heads form one row space (``h < Hq``: q, else k), so a token's q and k
heads share a program and small models still get full tiles. q and k may be
strided views (slices of a fused qkv projection); only the last dim must be
contiguous. ``rope_pair`` is the rotation itself, shared with the fused decode
attention kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ingot.ops.triton._common import last_dim_contiguous, next_pow2

# elements (rows x half head dim) per program: enough bytes in flight per SM
_TILE_ELEMS = 4096


@triton.jit
def _rne_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32, by integer ops.

    Written out rather than ``x.to(bf16).to(fp32)``: on the H200 that round trip
    did not round the products the way eager does (1-ulp differences in 19% of
    elements; the products of bf16 values are exact in fp32, so only a skipped
    intermediate rounding explains them). Integer ops cannot be folded away.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_to(x, dtype: tl.constexpr, BF16: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` and kept in fp32 (what one torch op in that dtype yields)."""
    if BF16:
        return _rne_bf16(x)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def load_cos_sin(cache_row_ptr, offs_half, mask, HALF: tl.constexpr, dtype: tl.constexpr, BF16: tl.constexpr):
    """cos and sin of a position (or rows of positions), cast to the activation dtype as the reference does."""
    cos = tl.load(cache_row_ptr + offs_half, mask=mask, other=0.0)
    sin = tl.load(cache_row_ptr + HALF + offs_half, mask=mask, other=0.0)
    return _round_to(cos, dtype, BF16), _round_to(sin, dtype, BF16)


@triton.jit
def rope_pair(x1, x2, cos, sin, BF16: tl.constexpr):
    """Rotate the halves (x1, x2): (x1 cos - x2 sin, x2 cos + x1 sin) in x's dtype, torch's roundings."""
    dtype = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    o1 = _round_to(_round_to(a1 * cos, dtype, BF16) + _round_to(-a2 * sin, dtype, BF16), dtype, BF16)
    o2 = _round_to(_round_to(a2 * cos, dtype, BF16) + _round_to(a1 * sin, dtype, BF16), dtype, BF16)
    return o1.to(dtype), o2.to(dtype)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr, q_out_ptr, k_out_ptr,
    num_tokens, num_q_heads, num_rows_per_token,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cache,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BF16: tl.constexpr,
):
    r = tl.arange(0, BLOCK_T * BLOCK_H)
    t = (tl.program_id(0) * BLOCK_T + r // BLOCK_H).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + r % BLOCK_H
    row_ok = (t < num_tokens) & (h < num_rows_per_token)
    is_q = h < num_q_heads
    hk = h - num_q_heads
    src = tl.where(is_q, q_ptr + t * stride_qt + h * stride_qh, k_ptr + t * stride_kt + hk * stride_kh)
    dst = tl.where(is_q, q_out_ptr + t * stride_qot + h * stride_qoh, k_out_ptr + t * stride_kot + hk * stride_koh)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = row_ok[:, None] & (offs_d < HALF)[None, :]
    pos = tl.load(pos_ptr + t, mask=row_ok, other=0).to(tl.int64)
    x1 = tl.load(src[:, None] + offs_d[None, :], mask=mask, other=0.0)
    x2 = tl.load(src[:, None] + HALF + offs_d[None, :], mask=mask, other=0.0)
    cos, sin = load_cos_sin(cache_ptr + pos[:, None] * stride_cache, offs_d[None, :], mask, HALF, x1.dtype, BF16)
    o1, o2 = rope_pair(x1, x2, cos, sin, BF16)
    tl.store(dst[:, None] + offs_d[None, :], o1.to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst[:, None] + HALF + offs_d[None, :], o2.to(q_out_ptr.dtype.element_ty), mask=mask)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of ``torch.ops.ingot.rotary_embedding``."""
    q_out = torch.empty_like(q)
    k_out = torch.empty_like(k)
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if num_tokens == 0:
        return q_out, k_out
    assert head_dim % 2 == 0, "rotary needs an even head dim"
    assert k.dtype == q.dtype, "q and k must share a dtype"
    q = last_dim_contiguous(q)
    k = last_dim_contiguous(k)
    cache = last_dim_contiguous(cos_sin_cache)
    half = head_dim // 2
    block_half = next_pow2(half)
    rows = num_q_heads + num_k_heads
    block_h = min(next_pow2(rows), max(1, _TILE_ELEMS // block_half))
    block_t = max(1, _TILE_ELEMS // (block_h * block_half))
    block_t = min(block_t, next_pow2(num_tokens))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(rows, block_h))
    _rotary_kernel[grid](
        positions, q, k, cache, q_out, k_out,
        num_tokens, num_q_heads, rows,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cache.stride(0),
        HALF=half, BLOCK_HALF=block_half, BLOCK_T=block_t, BLOCK_H=block_h,
        BF16=q.dtype == torch.bfloat16,
        num_warps=4 if block_t * block_h * block_half <= 2048 else 8,
    )
    return q_out, k_out
