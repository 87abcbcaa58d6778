"""Multi-head latent attention over the compressed paged cache (``ops/reference_mla.py``).

The cache entry of a token is ``[c (R values) | k_pe (P values)]`` in one row of
``kv_cache [blocks, page, 1, R + P]``; every head attends to the same entries
(multi-query attention) and the value is the key's prefix ``c``. R + P (576 for
DeepSeek) is no power of two, so the kernel keeps the two parts apart: the
scores of a tile are ``q_latent @ c^T + q_pe @ k_pe^T`` (two ``tl.dot``s over
R and P, each padded to a power of two by masks), and the accumulator is ``p @ c``.

Grid ``(B, head blocks, S)``: a program takes one sequence, ``BLOCK_H`` heads (the
M side of the dots, so each cache row is read once per head block) and one of
``S`` contiguous slices of the context, cut on the device from ``seq_lens[b]``.
With ``S == 1`` it writes the output; otherwise its normalised partial and
log-sum-exp go to fp32 scratch and a second launch merges them. ``S`` and the
scratch come from static shapes only (B, heads, the block table's width, the SM
count), so a captured graph serves any lengths. fp32 softmax and sums; output
in the query's dtype.

Prefill (``mla_prefill_attention``) runs the same kernel with one row per new
token: that token's sequence's block table and its causal length (its position
+ 1), so chunked prefill and prefix-cache hits read what the cache holds. Each
row reads its context once per head block: simple, not a tiled prefill kernel.
The launch table is not measured on a GPU yet (see ``launch_config``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ingot.ops.triton._common import cdiv, cuda_kernel, interpreting, last_dim_contiguous, next_pow2, num_sms

_LOG2E = 1.4426950408889634
MAX_SPLITS = 32


@dataclass(frozen=True)
class MLAConfig:
    """Launch parameters of the latent decode kernel."""

    block_h: int  # heads per program (the dots' M side; at least 16)
    block_n: int  # context tokens per tile
    num_warps: int
    num_stages: int


def launch_config(heads: int, rank: int, device: torch.device) -> MLAConfig:
    """A fixed table, not yet measured: 16 heads per program, 16-token tiles at DeepSeek's
    R = 512 (the [16, 512] fp32 accumulator and a [16, 512] latent tile per step), 32 below."""
    block_n = 16 if next_pow2(rank) >= 512 else 32
    return MLAConfig(block_h=16, block_n=block_n, num_warps=8 if rank >= 256 else 4, num_stages=2)


@triton.jit(do_not_specialize=["stride_bt"])
def _mla_kernel(
    ql_ptr, qp_ptr, cache_ptr, bt_ptr, lens_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, scale_log2,
    stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_cb, stride_cs, stride_bt, stride_ob, stride_oh,
    HEADS: tl.constexpr, R: tl.constexpr, P: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    h_mask, r_mask, p_mask = offs_h < HEADS, offs_r < R, offs_p < P

    seq_len = tl.load(lens_ptr + b)
    tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(tiles, NUM_SPLITS)
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, tiles)

    q_lat = tl.load(ql_ptr + b64 * stride_qlb + offs_h[:, None] * stride_qlh + offs_r[None, :],
                    mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    q_pe = tl.load(qp_ptr + b64 * stride_qpb + offs_h[:, None] * stride_qph + offs_p[None, :],
                   mask=h_mask[:, None] & p_mask[None, :], other=0.0)
    if DOT_F32:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    bt_row = bt_ptr + b64 * stride_bt
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + offs_n
        n_mask = pos < seq_len
        blk = tl.load(bt_row + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
        rows = cache_ptr + blk * stride_cb + (pos % PAGE) * stride_cs
        c = tl.load(rows[:, None] + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        k_pe = tl.load(rows[:, None] + R + offs_p[None, :], mask=n_mask[:, None] & p_mask[None, :], other=0.0)
        if DOT_F32:
            c = c.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        s = (tl.dot(q_lat, tl.trans(c)) + tl.dot(q_pe, tl.trans(k_pe))) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m_i = m_new

    hr_mask = h_mask[:, None] & r_mask[None, :]
    res = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # an empty slice (or seq_len 0): 0
    if NUM_SPLITS == 1:
        tl.store(out_ptr + b64 * stride_ob + offs_h[:, None] * stride_oh + offs_r[None, :],
                 res.to(out_ptr.dtype.element_ty), mask=hr_mask)
    else:
        row = (b64 * HEADS + offs_h) * NUM_SPLITS + split  # [BLOCK_H]
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + row, lse, mask=h_mask)
        tl.store(mid_o_ptr + row[:, None] * R + offs_r[None, :], res, mask=hr_mask)


@triton.jit
def _mla_merge(
    mid_o_ptr, mid_lse_ptr, out_ptr, stride_ob, stride_oh,
    HEADS: tl.constexpr, R: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """One (sequence, head): the S partials weighted by their log-sum-exps (empty ones weigh 0)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_r = tl.arange(0, BLOCK_R)
    s_mask, r_mask = offs_s < NUM_SPLITS, offs_r < R
    row = (b * HEADS + h) * NUM_SPLITS + offs_s
    lse = tl.load(mid_lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    o = tl.load(mid_o_ptr + row[:, None] * R + offs_r[None, :], mask=s_mask[:, None] & r_mask[None, :], other=0.0)
    total = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_r, res.to(out_ptr.dtype.element_ty), mask=r_mask)


def choose_num_splits(rows: int, head_blocks: int, max_tokens: int, block_n: int, device: torch.device) -> int:
    """Context slices per (row, head block) from static shapes: about one program per SM, never
    more slices than tiles of the longest context the block table holds, at most MAX_SPLITS."""
    programs = rows * head_blocks
    return max(1, min(MAX_SPLITS, cdiv(num_sms(device), programs), cdiv(max_tokens, block_n)))


@cuda_kernel
def mla_decode_attention(
    q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, num_splits: Optional[int] = None, config: Optional[MLAConfig] = None,
) -> torch.Tensor:
    q_latent, q_pe = last_dim_contiguous(q_latent), last_dim_contiguous(q_pe)
    rows, heads, rank = q_latent.shape
    rope = q_pe.shape[-1]
    page = kv_cache.shape[1]
    if kv_cache.shape[2] != 1 or kv_cache.shape[3] != rank + rope or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} is not [blocks, page, 1, {rank} + {rope}] with rows contiguous")
    cfg = config or launch_config(heads, rank, q_latent.device)
    head_blocks = cdiv(heads, cfg.block_h)
    splits = num_splits or choose_num_splits(rows, head_blocks, block_tables.shape[1] * page, cfg.block_n, q_latent.device)
    out = torch.empty_like(q_latent)
    if rows == 0:
        return out
    mid_o = mid_lse = out  # unused with one slice
    if splits > 1:
        mid_o = torch.empty(rows * heads * splits, rank, dtype=torch.float32, device=q_latent.device)
        mid_lse = torch.empty(rows * heads * splits, dtype=torch.float32, device=q_latent.device)
    block_r, block_p = max(16, next_pow2(rank)), max(16, next_pow2(rope))
    _mla_kernel[(rows, head_blocks, splits)](
        q_latent, q_pe, kv_cache, block_tables, seq_lens, out, mid_o, mid_lse, scale * _LOG2E,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        HEADS=heads, R=rank, P=rope, PAGE=page, NUM_SPLITS=splits, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
        BLOCK_R=block_r, BLOCK_P=block_p, DOT_F32=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        _mla_merge[(rows, heads)](mid_o, mid_lse, out, out.stride(0), out.stride(1), HEADS=heads, R=rank,
                                  NUM_SPLITS=splits, BLOCK_S=max(2, next_pow2(splits)), BLOCK_R=block_r,
                                  num_warps=4)
    return out


def prefill_rows(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                 num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block table [T, M], causal length [T]) of each new token: its sequence's table, and its
    position + 1 (the sequence's length less the new tokens after it). No host sync."""
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    seq = torch.repeat_interleave(torch.arange(q_lens.shape[0], device=q_lens.device), q_lens, output_size=num_tokens)
    after = cu_seqlens_q[1:].index_select(0, seq) - 1 - torch.arange(num_tokens, device=q_lens.device)
    return block_tables.index_select(0, seq), (seq_lens.index_select(0, seq) - after).to(torch.int32)


@cuda_kernel
def mla_prefill_attention(
    q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, config: Optional[MLAConfig] = None,
) -> torch.Tensor:
    tables, lens = prefill_rows(cu_seqlens_q, seq_lens, block_tables, q_latent.shape[0])
    return mla_decode_attention(q_latent, q_pe, kv_cache, tables, lens, scale, config=config)


@triton.jit
def _mla_store_kernel(
    lat_ptr, pe_ptr, cache_ptr, slot_ptr, stride_l, stride_p, stride_cb, stride_cs,
    R: tl.constexpr, P: tl.constexpr, PAGE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """One token's normed latent and rope'd key into its cache row."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    dst = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    latent = tl.load(lat_ptr + t * stride_l + offs_r, mask=offs_r < R)
    k_pe = tl.load(pe_ptr + t * stride_p + offs_p, mask=offs_p < P)
    tl.store(dst + offs_r, latent.to(cache_ptr.dtype.element_ty), mask=offs_r < R)
    tl.store(dst + R + offs_p, k_pe.to(cache_ptr.dtype.element_ty), mask=offs_p < P)


@cuda_kernel
def mla_store_kv(latent: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    latent = last_dim_contiguous(latent)
    k_pe = last_dim_contiguous(k_pe.reshape(k_pe.shape[0], -1))
    tokens, rank = latent.shape
    rope = k_pe.shape[-1]
    if tokens == 0:
        return
    _mla_store_kernel[(tokens,)](
        latent, k_pe, kv_cache, slot_mapping, latent.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        R=rank, P=rope, PAGE=kv_cache.shape[1], BLOCK_R=next_pow2(rank), BLOCK_P=next_pow2(rope), num_warps=4,
    )
