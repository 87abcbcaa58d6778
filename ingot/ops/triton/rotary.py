"""Neox-style rotary embedding on q [T, Hq, D] and k [T, Hkv, D] into fresh outputs.

``cos_sin_cache`` is ``[max_pos, D]``: cos in the first D/2 columns, sin in the
last D/2. Numerics follow ``reference.rotary_embedding`` under torch: the table
is cast to the activation dtype, and each of ``x * cos``, ``rotate_half(x) *
sin`` and their sum is rounded to that dtype (so bf16 results match torch's).

Layout: a 1-D grid of q tiles, then k tiles; a tile is [BLOCK_T tokens, BLOCK_H
heads, D/2 pairs] of one tensor, sized per tensor (about ``tile_pairs`` pairs),
so k's few heads and small models still get full tiles. A token's table row is
read once per tile and broadcast over its heads. q and k may be strided views
(slices of a fused qkv projection); only the last dim must be contiguous.

The kernel moves 4 bytes per pair each way and rounds 6 times per pair; with
integer rounding (``rounding.rne_bf16``) it would be compute-bound (58% of copy
bandwidth at T=4096, 28/4 heads), so on a GPU bf16 rounds through ``cvt`` in
``rounding.round_pair`` (81%; ``python -m benchmarks.kernels`` re-measures it). x and
the outputs are touched once, so they are loaded and stored with streaming cache
hints. ``rope_pair`` is the rotation itself, shared with the fused decode
attention kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ingot.ops.triton._common import cdiv, cuda_kernel, last_dim_contiguous, next_pow2
from ingot.ops.triton.rounding import round_pair, round_to


@dataclass(frozen=True)
class RotaryConfig:
    """Launch parameters of the rotary kernel (``launch_config`` picks them; sweeps pass their own)."""

    tile_pairs: int = 2048  # (token, head, pair) elements per program, all of a token's heads first
    num_warps: int = 4


def launch_config() -> RotaryConfig:
    """2048 pairs (8 KiB of x) and 4 warps per program for every shape: the best of
    1024-8192 pairs x 2-8 warps at 4096 tokens, 28/4 heads (the others 3-10% slower, or
    within noise; ``python -m benchmarks.kernels --sweep elementwise`` re-measures them)."""
    return RotaryConfig()


@triton.jit
def load_cos_sin(cache_row_ptr, offs_half, mask, HALF: tl.constexpr, dtype: tl.constexpr, BF16: tl.constexpr):
    """cos and sin of a position (or rows of positions), cast to the activation dtype as the reference does."""
    cos = tl.load(cache_row_ptr + offs_half, mask=mask, other=0.0)
    sin = tl.load(cache_row_ptr + HALF + offs_half, mask=mask, other=0.0)
    return round_to(cos, dtype, BF16), round_to(sin, dtype, BF16)


@triton.jit
def rope_pair(x1, x2, cos, sin, BF16: tl.constexpr):
    """Rotate the halves (x1, x2): (x1 cos - x2 sin, x2 cos + x1 sin) in x's dtype, torch's roundings."""
    dtype = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    p1, p2 = round_pair(a1 * cos, -a2 * sin, dtype, BF16)
    p3, p4 = round_pair(a2 * cos, a1 * sin, dtype, BF16)
    o1, o2 = round_pair(p1 + p2, p3 + p4, dtype, BF16)
    return o1.to(dtype), o2.to(dtype)


@triton.jit
def _rotate_tile(
    pid, pos_ptr, cache_ptr, x_ptr, out_ptr,
    num_tokens, num_heads, stride_xt, stride_xh, stride_ot, stride_oh, stride_cache,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    BF16: tl.constexpr,
):
    """Rotate tile ``pid`` ([BLOCK_T tokens, BLOCK_H heads], token-major) of one of q or k."""
    num_h_blocks = tl.cdiv(num_heads, BLOCK_H)
    offs_t = (pid // num_h_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = (pid % num_h_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)[None, None, :]
    t_ok = offs_t < num_tokens
    pos = tl.load(pos_ptr + offs_t, mask=t_ok, other=0).to(tl.int64)
    # one table row per token, [BLOCK_T, 1, BLOCK_HALF]: broadcast over the heads
    cs_mask = t_ok[:, None, None] & (offs_d < HALF)
    cos, sin = load_cos_sin(cache_ptr + pos[:, None, None] * stride_cache, offs_d, cs_mask,
                            HALF, x_ptr.dtype.element_ty, BF16)
    t = offs_t.to(tl.int64)[:, None, None]
    h = offs_h[None, :, None]
    src = x_ptr + t * stride_xt + h * stride_xh + offs_d
    dst = out_ptr + t * stride_ot + h * stride_oh + offs_d
    mask = cs_mask & (h < num_heads)
    x1 = tl.load(src, mask=mask, other=0.0, eviction_policy="evict_first")
    x2 = tl.load(src + HALF, mask=mask, other=0.0, eviction_policy="evict_first")
    o1, o2 = rope_pair(x1, x2, cos, sin, BF16)
    tl.store(dst, o1, mask=mask, cache_modifier=".cs")
    tl.store(dst + HALF, o2, mask=mask, cache_modifier=".cs")


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr, q_out_ptr, k_out_ptr,
    num_tokens, num_q_heads, num_k_heads, num_q_tiles,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cache,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_TQ: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_TK: tl.constexpr, BLOCK_HK: tl.constexpr,
    BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < num_q_tiles:
        _rotate_tile(pid, pos_ptr, cache_ptr, q_ptr, q_out_ptr, num_tokens, num_q_heads,
                     stride_qt, stride_qh, stride_qot, stride_qoh, stride_cache,
                     HALF, BLOCK_HALF, BLOCK_TQ, BLOCK_HQ, BF16)
    else:
        _rotate_tile(pid - num_q_tiles, pos_ptr, cache_ptr, k_ptr, k_out_ptr, num_tokens, num_k_heads,
                     stride_kt, stride_kh, stride_kot, stride_koh, stride_cache,
                     HALF, BLOCK_HALF, BLOCK_TK, BLOCK_HK, BF16)


def _tile(num_tokens: int, num_heads: int, block_half: int, elems: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_H, tiles): about ``elems`` pairs per program, all of a token's heads first."""
    block_h = min(next_pow2(num_heads), max(1, elems // block_half))
    block_t = min(max(1, elems // (block_h * block_half)), next_pow2(num_tokens))
    return block_t, block_h, cdiv(num_tokens, block_t) * cdiv(num_heads, block_h)


@cuda_kernel
def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
    config: Optional[RotaryConfig] = None,
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
    cfg = config or launch_config()
    block_tq, block_hq, q_tiles = _tile(num_tokens, num_q_heads, block_half, cfg.tile_pairs)
    block_tk, block_hk, k_tiles = _tile(num_tokens, num_k_heads, block_half, cfg.tile_pairs)
    _rotary_kernel[(q_tiles + k_tiles,)](
        positions, q, k, cache, q_out, k_out,
        num_tokens, num_q_heads, num_k_heads, q_tiles,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cache.stride(0),
        HALF=half, BLOCK_HALF=block_half,
        BLOCK_TQ=block_tq, BLOCK_HQ=block_hq, BLOCK_TK=block_tk, BLOCK_HK=block_hk,
        BF16=q.dtype == torch.bfloat16,
        num_warps=cfg.num_warps,
    )
    return q_out, k_out
