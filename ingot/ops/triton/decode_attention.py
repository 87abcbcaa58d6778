"""Paged decode attention: split-K flash-decoding over the block table, in one launch.

One query token per sequence, ``q [B, Hq, D]``, GQA with ``G = Hq / Hkv``.

Grid ``(B, Hkv, S)``: each program takes one sequence, one KV head and one of
``S`` contiguous slices of that sequence's context, and handles the whole
query-head group at once (the ``G`` query rows are the M side of a ``tl.dot``),
so each K/V row is read from memory once per group. Slices are cut on the
device from ``seq_lens[b]`` (so one captured graph serves any lengths); a slice
past the end of a short sequence yields an empty partial.

With ``S == 1`` a program writes the output directly. Otherwise it writes its
normalized partial and log-sum-exp (base 2) to fp32 scratch and bumps a
per-(sequence, KV head) counter; the program that finishes last merges the
``S`` partials and resets the counter to 0 for the next call (or graph replay).
So no second kernel is launched: at batch 1 that launch would be about a third of
the attention time. (If the counters cannot be allocated, during a capture that
needs more than were allocated before it, the merge runs as its own kernel.)

Fused variant (``decode_attention_rope``): the program also applies the rotary
embedding to q and to this step's k (after a per-head RMSNorm of both, for Qwen3's
q/k norm: two launches fewer per layer), and stores the new k/v row into the cache
by slot mapping. The new token is not read back from the cache: the one
program whose slice holds the last position puts it from registers into the tile
that holds it, where it is attended as a cached token (the same bits as the
three ops apart), and every program masks that position out of its cache reads,
so the store races with nothing. This replaces three launches per layer (rotary,
store_kv, attention) with one.

A sliding ``window`` (a local layer) starts the slices at the tile holding the first
visible position (``seq_len - window``): tiles wholly before it are never read, so a
local layer's decode reads its window whatever the context. ``softcap`` caps the
logits (``softcap.py``); ``sinks`` (gpt-oss) join the denominator where the output is
normalised: in the program that writes it directly, or in the merge of the slices.

``S`` comes from static shapes only (B, Hkv, the block table width and the SM
count), so it is fixed for a captured graph; scratch sizes likewise. No host
sync, no data-dependent allocation. fp32 softmax and accumulation; output in
``q.dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ingot.ops.triton._common import cdiv, cuda_kernel, interpreting, last_dim_contiguous, next_pow2, num_sms, split_counters
from ingot.ops.triton.pdl import pdl_supported, release_dependents, wait_for_producer
from ingot.ops.triton.rms_norm import head_norm_weights, head_rms_norm
from ingot.ops.triton.rotary import load_cos_sin, rope_pair
from ingot.ops.triton.softcap import scaled_logits, softmax_denominator

_LOG2E = 1.4426950408889634
MAX_SPLITS = 64


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel (``launch_config`` picks them; sweeps and tests pass their own)."""

    block_n: int  # context tokens per tile
    num_warps: int
    num_stages: int
    waves: int = 1  # programs aimed at per SM when cutting the context into slices
    merge_kernel: bool = False  # merge the slices in a second launch (what runs when split counters are missing)
    pdl: bool = False  # programmatic dependent launch (``pdl.py``): start during the previous kernel's tail


@triton.jit
def _merge_splits(
    mid_o_ptr, mid_lse_ptr, out_ptr, b, kvh, num_splits, num_used,
    stride_ob, stride_oh, sinks_ptr,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_GM: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Combine the first ``num_used`` of the S partials of one group's heads (the later
    ones are empty: a short context in a wide block table) with max-rescaled weights."""
    offs_g = tl.arange(0, BLOCK_GM)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    row0 = (b.to(tl.int64) * NUM_Q_HEADS + heads) * num_splits  # [G]
    m = tl.full([BLOCK_GM], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_GM], dtype=tl.float32)
    acc = tl.zeros([BLOCK_GM, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_used, BLOCK_S):
        s_idx = s0 + offs_s
        gs_mask = g_mask[:, None] & (s_idx < num_used)[None, :]
        rows = row0[:, None] + s_idx[None, :]  # [G, S]
        # .cg: read at L2, where the other programs' partials are (L1 is not coherent)
        lse = tl.load(mid_lse_ptr + rows, mask=gs_mask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(
            mid_o_ptr + rows[:, :, None] * HEAD_DIM + offs_d[None, None, :],
            mask=gs_mask[:, :, None] & d_mask[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m, tl.max(lse, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: weights 0
        alpha = tl.exp2(m - m_ref)
        w = tl.exp2(lse - m_ref[:, None])  # 0 for empty slices
        l = l * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 1)
        m = m_new
    res = acc / softmax_denominator(l, m, sinks_ptr, heads, g_mask, HAS_SINKS)[:, None]  # all empty: output 0
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
        res.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )


# the block table's width varies between eager steps, the window between layers: not specialized
@triton.jit(do_not_specialize=["stride_bt", "window"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, mid_o_ptr, mid_lse_ptr, counter_ptr,
    k_new_ptr, v_new_ptr, pos_ptr, cos_sin_ptr, slot_ptr, q_norm_ptr, k_norm_ptr, sinks_ptr,
    scale_log2, norm_eps, window, cap_log2,
    num_splits,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ob, stride_oh,
    stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GM: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    DIRECT: tl.constexpr, MERGE_HERE: tl.constexpr, ROPE: tl.constexpr, QK_NORM: tl.constexpr,
    BF16: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b64 = b.to(tl.int64)
    # every load that depends on nothing else is issued first, so their latencies overlap, and
    # before the PDL wait: the host writes the cache's metadata and no kernel the parameters
    # (0.992x the batch-1 graph step of the Qwen3-30B-A3B shape; its first K/V tile here too: 1.001x)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    offs_g = tl.arange(0, BLOCK_G)
    offs_h = tl.arange(0, BLOCK_HALF)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    h_mask = offs_h < HALF
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    if ROPE:
        pos = tl.load(pos_ptr + b).to(tl.int64)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        cos, sin = load_cos_sin(cos_sin_ptr + pos * stride_cs, offs_h, h_mask, HALF, q_ptr.dtype.element_ty, BF16)
        if QK_NORM:
            qn1, qn2 = head_norm_weights(q_norm_ptr, offs_h, h_mask, HALF)
            kn1, kn2 = head_norm_weights(k_norm_ptr, offs_h, h_mask, HALF)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    # a sliding window: the slices cover only the tiles from the first visible position on
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    tile0 = first // BLOCK_N
    tiles_per_split = tl.cdiv(num_tiles - tile0, num_splits)
    tile_lo = tile0 + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    wait_for_producer(PDL)  # q, k and v come from the previous kernel

    # q as two halves (the rotary pairs), so the fused variant rotates it in registers
    q_rows = q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + offs_h[None, :]
    gh_mask = g_mask[:, None] & h_mask[None, :]
    q1 = tl.load(q_rows, mask=gh_mask, other=0.0)
    q2 = tl.load(q_rows + HALF, mask=gh_mask, other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    if ROPE:
        k_row = k_new_ptr + b64 * stride_knb + kvh * stride_knh + offs_h
        k1 = tl.load(k_row, mask=h_mask, other=0.0)
        k2 = tl.load(k_row + HALF, mask=h_mask, other=0.0)
        v_new = tl.load(v_new_ptr + b64 * stride_vnb + kvh * stride_vnh + offs_d, mask=d_mask, other=0.0)
        if QK_NORM:
            q1, q2 = head_rms_norm(q1, q2, qn1, qn2, norm_eps, HEAD_DIM)
            k1, k2 = head_rms_norm(k1, k2, kn1, kn2, norm_eps, HEAD_DIM)
        q1, q2 = rope_pair(q1, q2, cos[None, :], sin[None, :], BF16)
        # the new token: rotated k and v from registers, stored by the program whose slice holds it
        # and attended inside its tile as a cached token is (its probability rounded for the PV dot
        # as theirs are), so the step computes what rotary + store_kv + decode_attention do
        owner = (seq_len > 0) & (split == (num_tiles - 1 - tile0) // tiles_per_split)
        k1, k2 = rope_pair(k1, k2, cos, sin, BF16)
        store = owner & (slot >= 0)
        k_dst = k_cache_ptr + (slot // PAGE) * stride_kb + (slot % PAGE) * stride_ks + kvh * stride_kh
        v_dst = v_cache_ptr + (slot // PAGE) * stride_vb + (slot % PAGE) * stride_vs + kvh * stride_vh
        tl.store(k_dst + offs_h, k1.to(k_cache_ptr.dtype.element_ty), mask=h_mask & store)
        tl.store(k_dst + HALF + offs_h, k2.to(k_cache_ptr.dtype.element_ty), mask=h_mask & store)
        tl.store(v_dst + offs_d, v_new.to(v_cache_ptr.dtype.element_ty), mask=d_mask & store)
        k1 = k1.to(k_cache_ptr.dtype.element_ty)
        k2 = k2.to(k_cache_ptr.dtype.element_ty)
        v_new = v_new.to(v_cache_ptr.dtype.element_ty)
    if DOT_F32:
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)

    bt_row = block_tables_ptr + b64 * stride_bt
    k_head = k_cache_ptr + kvh * stride_kh
    v_head = v_cache_ptr + kvh * stride_vh

    for tile in range(tile_lo, tile_hi):
        pos_n = tile * BLOCK_N + offs_n
        n_mask = (pos_n < seq_len) & (pos_n >= first)
        load_mask = n_mask  # positions read from the cache
        if ROPE:
            is_new = pos_n == seq_len - 1
            load_mask = n_mask & (pos_n != seq_len - 1)
        if PAGE % BLOCK_N == 0:
            # the whole tile lies in one cache block
            blk = tl.load(bt_row + (tile * BLOCK_N) // PAGE).to(tl.int64)
        else:
            blk = tl.load(bt_row + pos_n // PAGE, mask=load_mask, other=0).to(tl.int64)
        k_rows = k_head + blk * stride_kb + (pos_n % PAGE) * stride_ks
        v_rows = v_head + blk * stride_vb + (pos_n % PAGE) * stride_vs
        nh_mask = load_mask[:, None] & h_mask[None, :]
        k1t = tl.load(k_rows[:, None] + offs_h[None, :], mask=nh_mask, other=0.0)
        k2t = tl.load(k_rows[:, None] + HALF + offs_h[None, :], mask=nh_mask, other=0.0)
        if ROPE:
            k1t = tl.where(is_new[:, None], k1[None, :], k1t)
            k2t = tl.where(is_new[:, None], k2[None, :], k2t)
        if DOT_F32:
            k1t = k1t.to(tl.float32)
            k2t = k2t.to(tl.float32)
        s = scaled_logits(tl.dot(q1, tl.trans(k1t)) + tl.dot(q2, tl.trans(k2t)), scale_log2, cap_log2, SOFTCAP)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile of masked positions only
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_rows[:, None] + offs_d[None, :], mask=load_mask[:, None] & d_mask[None, :], other=0.0)
        if ROPE:
            v = tl.where(is_new[:, None], v_new[None, :], v)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    release_dependents(PDL)  # the next kernel may start while the slices are merged

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    gd_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT:
        o = acc / softmax_denominator(l_i, m_i, sinks_ptr, heads, g_mask, HAS_SINKS)[:, None]
        tl.store(
            out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=gd_mask,
        )
    else:
        o = acc / l_safe[:, None]  # the slice's partial; the merge adds the sinks
        # scratch layout: mid_o [B, Hq, S, D], mid_lse [B, Hq, S] (contiguous)
        row = (b64 * NUM_Q_HEADS + heads) * num_splits + split  # [BLOCK_G]
        tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=gd_mask)
        lse = m_i + tl.log2(l_safe)  # -inf for an empty slice
        tl.store(mid_lse_ptr + row, lse, mask=g_mask)
        if MERGE_HERE:
            tl.debug_barrier()  # every thread's partial is written before the release below
            counter = counter_ptr + b * NUM_KV_HEADS + kvh
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == num_splits - 1:
                # slices past the last tile hold nothing: a captured graph's S is sized for the
                # widest block table, so at short contexts most of them are empty
                num_used = tl.cdiv(num_tiles - tile0, tiles_per_split)
                _merge_splits(
                    mid_o_ptr, mid_lse_ptr, out_ptr, b, kvh, num_splits, num_used, stride_ob, stride_oh, sinks_ptr,
                    NUM_Q_HEADS, GROUP, BLOCK_GM, HEAD_DIM, BLOCK_D, BLOCK_S, HAS_SINKS,
                )
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, num_splits, stride_ob, stride_oh, sinks_ptr,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_GM: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    _merge_splits(
        mid_o_ptr, mid_lse_ptr, out_ptr, tl.program_id(0), tl.program_id(1), num_splits, num_splits, stride_ob, stride_oh,
        sinks_ptr, NUM_Q_HEADS, GROUP, BLOCK_GM, HEAD_DIM, BLOCK_D, BLOCK_S, HAS_SINKS,
    )


def launch_config(head_dim: int, programs: int, device: torch.device) -> DecodeConfig:
    """Launch parameters for a head dim and a count of (sequence, KV head) programs; fixed,
    no autotune; ``python -m benchmarks.kernels --sweep decode`` re-measures them. With at
    least half as many programs as SMs (batch 64: bandwidth-bound) 128-token tiles, 4 warps,
    3 stages, one wave of programs (fewer, longer slices beat more waves of short ones at
    batch 64, context 2048); half the tile, 8 warps, 2 stages at D=256. Below that (batch 1:
    latency-bound) two waves, so a long context is read by enough programs at once, and
    64-token tiles: 8 warps, 2 stages at D <= 128 (about 10% faster at batch 1, context 512);
    4 warps, 3 stages at D=256. H200, batch 1, a 32,768-token context, the kernel alone
    (``bench-decode-families-2026-12-03.json``): a Gemma-2-9B global layer (16 / 8 heads of
    256) 74.5 us at 32 slices against 154 us as launched before (17 slices of 32-token tiles,
    8 warps), a local one (window 4,096) 15.8 against 23.7 us; Qwen2.5-7B (28 / 4 heads of
    128) 38.4 us at 64 slices against 45.7 at 33. Slices past a short context read no tile.
    Programmatic dependent launch (``pdl.py``) on the latency-bound branch only."""
    latency_bound = 2 * programs < num_sms(device)
    if not latency_bound:
        block_n, num_warps, num_stages, waves = 128, 4, 3, 1
        if next_pow2(head_dim) > 128:
            block_n, num_warps, num_stages = 64, 8, 2
    else:
        block_n, num_warps, num_stages, waves = 64, 8, 2, 2
        if next_pow2(head_dim) > 128:
            num_warps, num_stages = 4, 3
    # PDL only where its neighbours are the skinny GEMVs (few rows); at batch 64 of Qwen2.5-1.5B,
    # between cuBLAS GEMMs, it would make the step 0.6-1.0% slower
    return DecodeConfig(block_n, num_warps, num_stages, waves, pdl=latency_bound and pdl_supported(device))


def choose_num_splits(
    batch: int, num_kv_heads: int, max_blocks: int, page: int, block_n: int, device: torch.device, waves: int = 1,
    window: int = 0,
) -> int:
    """Context slices per (sequence, KV head), from static shapes only.

    Enough programs for ``waves`` programs per SM, never more than the tiles of
    the longest context the block table can hold (or a sliding ``window`` spans),
    at most MAX_SPLITS.
    """
    programs = batch * num_kv_heads
    want = cdiv(waves * num_sms(device), max(programs, 1))
    max_tiles = max(1, cdiv(max_blocks * page, block_n))
    if window > 0:  # a window starting mid-tile touches one tile more than it fills
        max_tiles = min(max_tiles, cdiv(window, block_n) + 1)
    return int(max(1, min(want, max_tiles, MAX_SPLITS)))


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: Optional[int],
    rope: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    config: Optional[DecodeConfig],
    qk_norm: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    batch, num_q_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    assert head_dim % 2 == 0, "decode attention needs an even head dim"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "KV cache rows must be contiguous"
    q = last_dim_contiguous(q)
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_g = max(16, next_pow2(group))
    block_gm = max(2, next_pow2(group))
    block_d = max(16, next_pow2(head_dim))
    block_half = max(16, next_pow2(head_dim // 2))
    cfg = config or launch_config(head_dim, batch * num_kv_heads, q.device)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, block_tables.shape[1], page, cfg.block_n, q.device, cfg.waves,
                                       window)
    direct = num_splits == 1
    block_s = max(2, min(next_pow2(num_splits), 4096 // (block_gm * block_d)))
    counters = None
    if direct:
        mid_o = mid_lse = out  # unused
    else:
        mid_o = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
        if not cfg.merge_kernel:
            counters = split_counters(q.device, batch * num_kv_heads)
    merge_here = counters is not None
    pdl = cfg.pdl and pdl_supported(q.device)
    if rope is None:
        k_new = v_new = q
        positions = slots = seq_lens
        cos_sin = q
    else:
        k_new, v_new, positions, cos_sin, slots = rope
        k_new, v_new, cos_sin = last_dim_contiguous(k_new), last_dim_contiguous(v_new), last_dim_contiguous(cos_sin)
    if qk_norm is None:
        q_norm = k_norm = q
        norm_eps = 0.0
    else:
        assert rope is not None, "the q/k norm is folded into the fused rotary variant only"
        q_norm, k_norm, norm_eps = qk_norm
        assert q_norm.shape == k_norm.shape == (head_dim,), "q/k norm weights are per head"
        q_norm, k_norm = q_norm.contiguous(), k_norm.contiguous()
    sinks_arg = q if sinks is None else sinks.contiguous()
    assert sinks is None or sinks.shape == (num_q_heads,), "one sink per query head"
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens,
        out, mid_o, mid_lse, counters if merge_here else seq_lens,
        k_new, v_new, positions, cos_sin, slots, q_norm, k_norm, sinks_arg,
        float(scale) * _LOG2E, float(norm_eps), max(int(window), 0), float(softcap) * _LOG2E,
        num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), cos_sin.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads,
        GROUP=group, BLOCK_G=block_g, BLOCK_GM=block_gm,
        HEAD_DIM=head_dim, BLOCK_D=block_d, HALF=head_dim // 2, BLOCK_HALF=block_half,
        PAGE=page, BLOCK_N=cfg.block_n, BLOCK_S=block_s,
        DIRECT=direct, MERGE_HERE=merge_here, ROPE=rope is not None, QK_NORM=qk_norm is not None,
        BF16=q.dtype == torch.bfloat16, DOT_F32=interpreting(), PDL=pdl, SOFTCAP=softcap > 0, HAS_SINKS=sinks is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    if not direct and not merge_here:
        _merge_kernel[(batch, num_kv_heads)](
            mid_o, mid_lse, out, num_splits, out.stride(0), out.stride(1), sinks_arg,
            NUM_Q_HEADS=num_q_heads, GROUP=group, BLOCK_GM=block_gm,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=block_s, HAS_SINKS=sinks is not None,
            num_warps=4,
        )
    return out


@cuda_kernel
def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    num_splits: Optional[int] = None,
    config: Optional[DecodeConfig] = None,
) -> torch.Tensor:
    """Triton implementation of ``torch.ops.ingot.decode_attention`` (see reference.py);
    ``num_splits`` and ``config`` override ``choose_num_splits`` and ``launch_config``."""
    return _launch(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, None, config, None, window, softcap,
                   sinks)


@cuda_kernel
def decode_attention_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 0.0,
    window: int = 0,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    num_splits: Optional[int] = None,
    config: Optional[DecodeConfig] = None,
) -> torch.Tensor:
    """Triton implementation of ``torch.ops.ingot.decode_attention_rope``: (RMSNorm of each
    q and k head, with both weights given,) rotary on q and k, k/v stored at
    ``slot_mapping``, attention over the cache (new token included)."""
    assert k.dtype == q.dtype == v.dtype, "q, k and v must share a dtype"
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("decode_attention_rope folds q and k norms together: pass both weights or neither")
    qk_norm = None if q_norm_weight is None else (q_norm_weight, k_norm_weight, norm_eps)
    return _launch(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits,
                   (k, v, positions, cos_sin_cache, slot_mapping), config, qk_norm, window, softcap, sinks)


__all__ = ["decode_attention", "decode_attention_rope", "choose_num_splits", "launch_config", "DecodeConfig", "MAX_SPLITS"]
