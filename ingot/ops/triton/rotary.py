"""Neox-style rotary embedding on q [T, Hq, D] and k [T, Hkv, D] into fresh outputs.

``cos_sin_cache`` is ``[max_pos, D]``: cos in the first D/2 columns, sin in the
last D/2. Numerics follow ``reference.rotary_embedding`` under torch: the table
is cast to the activation dtype, and each of ``x * cos``, ``rotate_half(x) *
sin`` and their sum is rounded to that dtype (so bf16 results match torch's).

Grid ``(T, q head chunks + k head chunks)``: each program rotates a chunk of
heads of one token, loading that token's cos/sin row once. q and k may be
strided views (slices of a fused qkv projection); only the last dim must be
contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ingot.ops.triton._common import last_dim_contiguous, next_pow2


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
def _rotate_chunk(
    src_ptr, dst_ptr, t, h0, num_heads,
    stride_st, stride_sh, stride_dt, stride_dh,
    cos, sin,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BF16: tl.constexpr,
):
    offs_h = h0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < num_heads)[:, None] & (offs_d < HALF)[None, :]
    src = src_ptr + t * stride_st + offs_h[:, None] * stride_sh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    # first half: x1 * cos + (-x2) * sin; second half: x2 * cos + x1 * sin
    if BF16:
        o1 = _rne_bf16(_rne_bf16(a1 * c) + _rne_bf16(-a2 * s)).to(dtype)
        o2 = _rne_bf16(_rne_bf16(a2 * c) + _rne_bf16(a1 * s)).to(dtype)
    else:
        o1 = ((a1 * c).to(dtype).to(tl.float32) + (-a2 * s).to(dtype).to(tl.float32)).to(dtype)
        o2 = ((a2 * c).to(dtype).to(tl.float32) + (a1 * s).to(dtype).to(tl.float32)).to(dtype)
    dst = dst_ptr + t * stride_dt + offs_h[:, None] * stride_dh + offs_d[None, :]
    tl.store(dst, o1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, o2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr, q_out_ptr, k_out_ptr,
    num_q_heads, num_k_heads, q_chunks,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cache,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BF16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    row = cache_ptr + pos * stride_cache
    cos = tl.load(row + offs_d, mask=d_mask, other=0.0)
    sin = tl.load(row + HALF + offs_d, mask=d_mask, other=0.0)
    # the table is cast to the activation dtype first, as the reference does
    if BF16:
        cos = _rne_bf16(cos)
        sin = _rne_bf16(sin)
    else:
        cos = cos.to(q_ptr.dtype.element_ty).to(tl.float32)
        sin = sin.to(q_ptr.dtype.element_ty).to(tl.float32)
    if chunk < q_chunks:
        _rotate_chunk(
            q_ptr, q_out_ptr, t, chunk * BLOCK_H, num_q_heads,
            stride_qt, stride_qh, stride_qot, stride_qoh,
            cos, sin, HALF, BLOCK_H, BLOCK_HALF, BF16,
        )
    else:
        _rotate_chunk(
            k_ptr, k_out_ptr, t, (chunk - q_chunks) * BLOCK_H, num_k_heads,
            stride_kt, stride_kh, stride_kot, stride_koh,
            cos, sin, HALF, BLOCK_H, BLOCK_HALF, BF16,
        )


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
    block_h = max(1, min(next_pow2(max(num_q_heads, num_k_heads)), 2048 // block_half))
    q_chunks = triton.cdiv(num_q_heads, block_h)
    k_chunks = triton.cdiv(num_k_heads, block_h)
    elems = block_h * block_half
    _rotary_kernel[(num_tokens, q_chunks + k_chunks)](
        positions, q, k, cache, q_out, k_out,
        num_q_heads, num_k_heads, q_chunks,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cache.stride(0),
        HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half, BF16=q.dtype == torch.bfloat16,
        num_warps=4 if elems <= 1024 else 8,
    )
    return q_out, k_out
