"""Paged decode attention: split-K flash-decoding over the block table.

One query token per sequence, ``q [B, Hq, D]``, GQA with ``G = Hq / Hkv``.

Kernel 1 (``_decode_split_kernel``), grid ``(B, Hkv, S)``: each program takes
one sequence, one KV head and one of ``S`` contiguous slices of that sequence's
context, and handles the whole query-head group at once (the ``G`` query rows
are the M side of a ``tl.dot``), so each K/V row is read from memory once per
group. Slices are cut on the device from ``seq_lens[b]`` (so the same captured
graph serves any lengths); a slice past the end of a short sequence writes an
empty partial. It writes the slice's normalized partial output and its
log-sum-exp (base 2) to fp32 scratch; with ``S == 1`` it writes the final
output directly and the second kernel is skipped.

Kernel 2 (``_decode_reduce_kernel``), grid ``(B, Hq)``: merges the ``S``
partials of each head with the usual max-rescaled weights.

``S`` comes from static shapes only (B, Hkv, the block table width and the SM
count), so it is fixed for a captured graph; scratch sizes likewise. No host
sync, no data-dependent allocation. fp32 softmax and accumulation; output in
``q.dtype``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ingot.ops.triton._common import cdiv, interpreting, last_dim_contiguous, next_pow2, num_sms

_LOG2E = 1.4426950408889634
MAX_SPLITS = 64
# programs we aim to launch, in units of SMs (a few waves balance uneven lengths)
_TARGET_WAVES = 4
# Optional override for tuning sweeps (benchmarks/kernels.py): keys BLOCK_N,
# num_warps, num_stages, waves. Empty in normal use.
CONFIG_OVERRIDE: dict = {}


# the block table's width varies between eager steps: not specialized
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, mid_o_ptr, mid_lse_ptr,
    scale_log2,
    num_splits,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ob, stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g

    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kvh * stride_kh
    v_head = v_cache_ptr + kvh * stride_vh

    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + offs_n
        n_mask = pos < seq_len
        if PAGE % BLOCK_N == 0:
            # the whole tile lies in one cache block
            blk = tl.load(bt_row + (tile * BLOCK_N) // PAGE).to(tl.int64)
            k_rows = blk * stride_kb + (pos % PAGE) * stride_ks
            v_rows = blk * stride_vb + (pos % PAGE) * stride_vs
        else:
            blk = tl.load(bt_row + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
            k_rows = blk * stride_kb + (pos % PAGE) * stride_ks
            v_rows = blk * stride_vb + (pos % PAGE) * stride_vs
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_head + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale_log2  # [BLOCK_G, BLOCK_N], log2 domain
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    store_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT:
        tl.store(
            out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    else:
        # scratch layout: mid_o [B, Hq, S, D], mid_lse [B, Hq, S] (contiguous)
        row = (b.to(tl.int64) * NUM_Q_HEADS + heads) * num_splits + split  # [BLOCK_G]
        tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=store_mask)
        lse = m_i + tl.log2(l_safe)  # -inf for an empty slice
        tl.store(mid_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr,
    num_splits,
    stride_ob, stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    row0 = (b.to(tl.int64) * NUM_Q_HEADS + h) * num_splits
    lse = tl.load(mid_lse_ptr + row0 + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every slice empty (seq_len 0): output 0
    w = tl.exp2(lse - m)  # 0 for empty slices
    denom = tl.sum(w, 0)
    o = tl.load(
        mid_o_ptr + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    res = tl.sum(o * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
        res.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def _tile_config(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for a head dim; fixed, no autotune."""
    # K and V tiles of BLOCK_N x D bf16: 16 KiB each up to D=128 (32 tokens at D=256)
    cfg = (64, 4, 3) if next_pow2(head_dim) <= 128 else (32, 4, 3)
    o = CONFIG_OVERRIDE
    return o.get("BLOCK_N", cfg[0]), o.get("num_warps", cfg[1]), o.get("num_stages", cfg[2])


def choose_num_splits(batch: int, num_kv_heads: int, max_blocks: int, page: int, block_n: int, device: torch.device) -> int:
    """Context slices per (sequence, KV head), from static shapes only.

    Enough programs for ``_TARGET_WAVES`` programs per SM, never more than the
    tiles of the longest context the block table can hold, at most MAX_SPLITS.
    """
    programs = batch * num_kv_heads
    waves = CONFIG_OVERRIDE.get("waves", _TARGET_WAVES)
    want = cdiv(waves * num_sms(device), max(programs, 1))
    max_tiles = max(1, cdiv(max_blocks * page, block_n))
    return int(max(1, min(want, max_tiles, MAX_SPLITS)))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: Optional[int] = None,
) -> torch.Tensor:
    """Triton implementation of ``torch.ops.ingot.decode_attention`` (see reference.py)."""
    batch, num_q_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "KV cache rows must be contiguous"
    q = last_dim_contiguous(q)
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    out = torch.empty_like(q)
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_g = max(16, next_pow2(group))
    block_d = max(16, next_pow2(head_dim))
    block_n, num_warps, num_stages = _tile_config(head_dim)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, block_tables.shape[1], page, block_n, q.device)
    direct = num_splits == 1
    if direct:
        mid_o = mid_lse = out  # unused
    else:
        mid_o = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    dot_f32 = interpreting()
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens,
        out, mid_o, mid_lse,
        float(scale) * _LOG2E,
        num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        NUM_Q_HEADS=num_q_heads,
        GROUP=group, BLOCK_G=block_g,
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE=page, BLOCK_N=block_n,
        DIRECT=direct, DOT_F32=dot_f32,
        num_warps=num_warps, num_stages=num_stages,
    )
    if not direct:
        block_s = max(2, next_pow2(num_splits))
        _decode_reduce_kernel[(batch, num_q_heads)](
            mid_o, mid_lse, out,
            num_splits,
            out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_q_heads,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=block_s,
            num_warps=4 if block_s * block_d <= 8192 else 8,
        )
    return out


__all__ = ["decode_attention", "choose_num_splits", "MAX_SPLITS", "CONFIG_OVERRIDE"]
