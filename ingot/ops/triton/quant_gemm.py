"""The kernels behind int_linear.py and fp8_linear.py: y = x @ W.T (+ b) with W quantized,
made dot operands tile by tile in registers (never a full-precision copy of W).

* ``_gemv_kernel`` (a decode batch, up to 64 rows): skinny_gemm's split-K GEMV. Each program
  streams a ``BLOCK_N x K/S`` slab of W, the last of a tile's S programs sums the fp32
  partials (split counters of ``_common``), adds the bias and writes.
* ``_gemm_kernel`` (more rows): a tiled GEMM, grouped tile order for L2 reuse.

Both take one of two K loops:

* ``TILES`` (16-bit models, W's groups of 64 columns or more): quant_tiles.py's
  ``tile_sums``, each K tile in one group of W (and of x's W8A8 scales), dotted on tensor
  cores from one row up (rows padded to 16) on W's exact values (``u - zero``; fp8 values),
  the sums scaled per tile, or once at the end where one group spans K. int4 becomes
  ``128 + u`` in bf16 with no float op per weight; fp8 W8A8 (``FP8_DOT``) dots the fp8
  activations with the raw tile. Counted on sm_90 (``benchmarks/quant_sass.py``): 1.7 to
  3.7 instructions a weight, where HBM leaves about 3.5 to an int4 weight at batch 1.
* otherwise (GGUF's groups of 16 and 32, fp32 models): the tile held as
  ``[BLOCK_N, BLOCK_K / GS_TILE, GS_TILE]`` (``_weight_tile``: each run of ``GS_TILE``
  columns of a row shares a scale and a min), dequantized to x's dtype and dotted, or for
  one row (``USE_DOT`` off) streamed through a multiply-reduce with the scales applied per
  group to the partial sums (``sum((u - z) * x) * s + min * sum(x)``).

Integer values become floats by the exponent trick (the value's bits under 0x4B000000 make
``2**23 + u``, minus ``2**23 + zero``: exact, no int-to-float conversion); on a GPU one
``prmt`` a value (quant_tiles.py). fp8 bytes convert in hardware on sm_89+ (``fp8_native``),
else by moving their bits under fp32's and scaling by 2**120. Column groups are powers of
two or whole rows (else the ops run the reference): indices by shifts (``shift_of``).

W8A8 (fp8 weights only): x holds fp8 activations (``fp8_linear.act_quant``), exact in bf16,
and their scales apply to the sums: per K tile for groups (a tile lies in one group), once
at the end per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ingot.ops.triton._common import cdiv, interpreting, next_pow2, num_sms, split_counters
from ingot.ops.triton.quant_tiles import act_in, dot, e4m3_to_f32, tile_sums, unpack
from ingot.ops.triton.pdl import pdl_supported, release_dependents, wait_for_producer

MAX_GEMV_ROWS = 64  # rows the split-K GEMV takes (tl.dot on rows padded to 16, 32 or 64)


def gemv_rows(m: int, n: int, device: torch.device) -> bool:
    """Whether ``m`` rows of an [n, k] weight go to the split-K GEMV rather than the tiled GEMM.
    Up to 16 rows always; up to 64 while the GEMM's 64 x 128 tiles would not fill the SMs
    (H200, 7B shapes at 64 rows: qkv / o / down int8 24 / 19 / 76 us on the GEMV against
    48 / 49 / 300 on the GEMM; gate_up, 296 tiles, 103 against 89)."""
    return m <= 16 or (m <= MAX_GEMV_ROWS and cdiv(m, 64) * cdiv(n, 128) < num_sms(device))


@dataclass(frozen=True)
class QuantLaunch:
    """Launch parameters of the quantized GEMV / GEMM (each op's ``launch_config`` picks them)."""

    gemv: bool  # split-K GEMV (at most 64 rows), else the tiled GEMM
    use_dot: bool  # GEMV: tl.dot on rows padded to 16, else a one-row multiply-reduce
    block_m: int  # GEMM rows per tile (the GEMV pads rows to 16 or takes one)
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    waves: int = 4  # GEMV: programs aimed at per SM when choosing the split count
    splits: Optional[int] = None  # GEMV K splits; None: from ``waves``
    group_m: int = 8  # GEMM: row tiles per band of the tile order
    pdl: bool = False  # GEMV: programmatic dependent launch (pdl.py)
    fp8_native: bool = False  # fp8: hardware conversions (sm_89+), else bit decoding
    fp8_dot: bool = False  # fp8 W8A8 dots on fp8 tensor cores, GEMV and GEMM (needs fp8_native)
    scaled_mm: bool = False  # fp8 W8A8 GEMM by torch._scaled_mm where its scale layouts fit
    prmt: bool = True  # int: unpack by prmt / lop3 (inline asm, GPU only), else by shifts and masks


@dataclass(frozen=True)
class QuantWeight:
    """A quantized [n, k] weight as the kernels read it. ``data``: int32 words [n, k * bits / 32]
    or fp8 [n, k]; ``scales`` (and ``zeros`` / ``mins``) [cdiv(n, scale_bn), cdiv(k, group_k)]."""

    data: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]
    mins: Optional[torch.Tensor]
    n: int
    k: int
    fp8: bool
    bits: int  # 4 or 8 (fp8: 8)
    group_k: int  # columns per scale
    scale_bn: int = 1  # rows per scale
    zero_point: int = 0


def fits_tiles(group: int, k: int) -> bool:
    """Whether K tiles can align with groups of ``group`` columns: one group spans the row, or a power of two."""
    return group >= k or (group > 0 and group & (group - 1) == 0)


def group_tile(block_k: int, group_k: int, k: int) -> int:
    """Columns of a K tile that share one scale: the whole tile where one group spans K."""
    return block_k if group_k >= k else min(block_k, group_k)


# ----------------------------------------------------------------------------- device helpers
@triton.jit
def _weight_tile(
    w_ptr, s_ptr, z_ptr, mn_ptr, offs_n, n_mask, k0, K, KW, G, stride_wn, stride_sn, zero_point, scale_bn, group_shift,
    FP8: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr,
    FP8_NATIVE: tl.constexpr, PRMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GS_TILE: tl.constexpr,
):
    """W's tile at rows ``offs_n``, columns ``k0 + [0, BLOCK_K)``: (values [BLOCK_N, NG, GS_TILE]
    in fp32, ``u - zero`` or the fp8 value; scales and mins [BLOCK_N, NG]), NG = BLOCK_K / GS_TILE.
    Columns past K read as zero weights with zero scales. ``KW``: int32 words per row (an argument
    of its own, so that its divisibility lets the word loads vectorize)."""
    NG: tl.constexpr = BLOCK_K // GS_TILE
    offs_g = tl.arange(0, NG)
    gidx = (k0 + offs_g * GS_TILE) >> group_shift
    g_mask = n_mask[:, None] & (gidx < G)[None, :]
    s_off = (offs_n // scale_bn)[:, None] * stride_sn + gidx[None, :]
    scale = tl.load(s_ptr + s_off, mask=g_mask, other=0.0).to(tl.float32)
    mins = tl.zeros([BLOCK_N, NG], dtype=tl.float32)
    if HAS_MINS:
        mins = tl.load(mn_ptr + s_off, mask=g_mask, other=0.0).to(tl.float32)
    rows = w_ptr + offs_n.to(tl.int64)[:, None, None] * stride_wn
    if FP8:
        cols = k0 + offs_g[:, None] * GS_TILE + tl.arange(0, GS_TILE)[None, :]
        raw = tl.load(rows + cols[None, :, :], mask=n_mask[:, None, None] & (cols < K)[None, :, :], other=0.0)
        values = e4m3_to_f32(raw, FP8_NATIVE)
    else:
        PACK: tl.constexpr = 32 // BITS
        GW: tl.constexpr = GS_TILE // PACK
        # (k0 // BLOCK_K) * words per tile, not k0 // PACK: its divisibility lets the loads vectorize
        kw = (k0 // BLOCK_K) * (BLOCK_K // PACK) + offs_g[:, None] * GW + tl.arange(0, GW)[None, :]
        words = tl.load(rows + kw[None, :, :], mask=n_mask[:, None, None] & (kw < KW)[None, :, :], other=0)
        u = tl.reshape(unpack(words, BITS, PRMT), (BLOCK_N, NG, GS_TILE))  # 2**23 + u
        if HAS_ZEROS:
            zero = tl.load(z_ptr + s_off, mask=g_mask, other=0).to(tl.float32)
        else:
            zero = tl.zeros([BLOCK_N, NG], dtype=tl.float32) + zero_point
        values = u - (zero + 8388608.0)[:, :, None]
    return values, scale, mins


@triton.jit
def _dequantize(values, scale, mins, HAS_MINS: tl.constexpr):
    """The weights of a tile from ``_weight_tile``: values * scale (+ min), fp32."""
    if HAS_MINS:
        return values * scale[:, :, None] + mins[:, :, None]
    else:
        return values * scale[:, :, None]


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _gemv_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, z_ptr, mn_ptr, b_ptr, y_ptr, part_ptr, counter_ptr,
    M, N, K, KW, G, k_per_split, zero_point, scale_bn, group_shift, act_shift, n_act,
    stride_xm, stride_wn, stride_sn, stride_ym,
    FP8: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr,
    FP8_NATIVE: tl.constexpr, PRMT: tl.constexpr, ACT_Q: tl.constexpr, PER_TOKEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    DIRECT: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GS_TILE: tl.constexpr, PDL: tl.constexpr,
    TILES: tl.constexpr, FP8_DOT: tl.constexpr, EVEN_K: tl.constexpr, ONE_GROUP: tl.constexpr,
):
    """``ACT_Q``: x holds fp8 activations and ``xs`` their scales [M, n_act], one per
    ``1 << act_shift`` columns (``PER_TOKEN``: one per row, applied to the sums). Groups of weight
    columns (one scale each): ``1 << group_shift`` (31: the whole row)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_splits = tl.num_programs(1)
    NG: tl.constexpr = BLOCK_K // GS_TILE
    GROUPED_ACT: tl.constexpr = ACT_Q and not PER_TOKEN
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    wait_for_producer(PDL)  # from here on, what the previous kernels wrote
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if TILES:  # each K tile in one group of W (and of x's scales): quant_tiles.tile_sums
        acc = tile_sums(
            acc, x_ptr, xs_ptr, w_ptr, s_ptr, z_ptr, mn_ptr, offs_m, offs_n, M, N, K, k_lo, k_hi, stride_xm, stride_wn,
            stride_sn, zero_point, scale_bn, group_shift, act_shift, n_act, FP8, BITS, HAS_ZEROS, HAS_MINS, FP8_NATIVE,
            PRMT, ACT_Q, GROUPED_ACT, FP8_DOT, DOT_F32, EVEN_K, ONE_GROUP, BLOCK_K, y_ptr.dtype.element_ty)
    else:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            values, scale, mins = _weight_tile(
                w_ptr, s_ptr, z_ptr, mn_ptr, offs_n, n_mask, k0, K, KW, G, stride_wn, stride_sn, zero_point, scale_bn,
                group_shift, FP8, BITS, HAS_ZEROS, HAS_MINS, FP8_NATIVE, PRMT, BLOCK_N, BLOCK_K, GS_TILE)
            if USE_DOT:
                offs_k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                            mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
                x = act_in(x, y_ptr.dtype.element_ty, ACT_Q, FP8_NATIVE)
                part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                if NG == 1:  # one group: the dot on the exact values (u - z, fp8 values), its sums scaled
                    part = dot(part, x, tl.reshape(values, (BLOCK_N, BLOCK_K)).to(x.dtype), DOT_F32, IEEE)
                    part *= tl.reshape(scale, (BLOCK_N,))[None, :]
                    if HAS_MINS:
                        part += tl.sum(x.to(tl.float32), axis=1)[:, None] * tl.reshape(mins, (BLOCK_N,))[None, :]
                else:
                    w = tl.reshape(_dequantize(values, scale, mins, HAS_MINS), (BLOCK_N, BLOCK_K)).to(x.dtype)
                    part = dot(part, x, w, DOT_F32, IEEE)
                if GROUPED_ACT:  # the K tile lies in one activation group
                    part *= tl.load(xs_ptr + offs_m * n_act + (k0 >> act_shift), mask=m_mask, other=0.0)[:, None]
                acc += part
            else:  # one row: W streamed through a multiply-reduce, scales applied per group of the sums
                cols = k0 + tl.arange(0, NG)[:, None] * GS_TILE + tl.arange(0, GS_TILE)[None, :]
                x = act_in(tl.load(x_ptr + cols, mask=cols < K, other=0.0), tl.float32, ACT_Q, FP8_NATIVE)
                if GROUPED_ACT:
                    x *= tl.load(xs_ptr + (cols >> act_shift), mask=cols < K, other=0.0)
                sums = tl.sum(values * x[None, :, :], axis=2)
                if HAS_MINS:
                    sums = sums * scale + mins * tl.sum(x, axis=1)[None, :]
                else:
                    sums = sums * scale
                acc += tl.sum(sums, axis=1)[None, :]
    release_dependents(PDL)  # the next kernel may launch while the merges run
    if ACT_Q and PER_TOKEN:
        acc *= tl.load(xs_ptr + offs_m * n_act, mask=m_mask, other=0.0)[:, None]
    mn_mask = m_mask[:, None] & n_mask[None, :]
    y_tile = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if DIRECT:
        tl.store(y_tile, (acc + bias[None, :]).to(y_ptr.dtype.element_ty), mask=mn_mask)
    else:  # partials [S, BLOCK_M, N] fp32; the tile's last program sums them in split order
        part_tile = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_tile + pid_k * BLOCK_M * N, acc, mask=mn_mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        done = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == num_splits - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(0, num_splits):
                total += tl.load(part_tile + s * BLOCK_M * N, mask=mn_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_tile, (total + bias[None, :]).to(y_ptr.dtype.element_ty), mask=mn_mask)
            tl.atomic_xchg(counter_ptr + pid_n, 0, sem="relaxed", scope="gpu")


@triton.jit
def _gemm_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, z_ptr, mn_ptr, b_ptr, y_ptr,
    M, N, K, KW, G, zero_point, scale_bn, group_shift, act_shift, n_act,
    stride_xm, stride_wn, stride_sn, stride_ym,
    FP8: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr,
    FP8_NATIVE: tl.constexpr, PRMT: tl.constexpr, ACT_Q: tl.constexpr, PER_TOKEN: tl.constexpr, FP8_DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GS_TILE: tl.constexpr, GROUP_M: tl.constexpr,
    TILES: tl.constexpr, EVEN_K: tl.constexpr, ONE_GROUP: tl.constexpr,
):
    """x, ``xs`` and the constexprs as in the GEMV."""
    pid = tl.program_id(0)
    GROUPED_ACT: tl.constexpr = ACT_Q and not PER_TOKEN
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * tiles_n  # bands of GROUP_M row tiles, walked column by column: B tiles reused from L2
    first_m = (pid // band) * GROUP_M
    rows_in_band = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % rows_in_band
    pid_n = (pid % band) // rows_in_band
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if TILES:  # as in the GEMV
        acc = tile_sums(
            acc, x_ptr, xs_ptr, w_ptr, s_ptr, z_ptr, mn_ptr, offs_m, offs_n, M, N, K, 0, K, stride_xm, stride_wn,
            stride_sn, zero_point, scale_bn, group_shift, act_shift, n_act, FP8, BITS, HAS_ZEROS, HAS_MINS, FP8_NATIVE,
            PRMT, ACT_Q, GROUPED_ACT, FP8_DOT, DOT_F32, EVEN_K, ONE_GROUP, BLOCK_K, y_ptr.dtype.element_ty)
    else:  # tiles dequantized to x's dtype (groups narrower than the tile; fp32 models)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
            x = act_in(x, y_ptr.dtype.element_ty, ACT_Q, FP8_NATIVE)
            values, scale, mins = _weight_tile(
                w_ptr, s_ptr, z_ptr, mn_ptr, offs_n, n_mask, k0, K, KW, G, stride_wn, stride_sn, zero_point, scale_bn,
                group_shift, FP8, BITS, HAS_ZEROS, HAS_MINS, FP8_NATIVE, PRMT, BLOCK_N, BLOCK_K, GS_TILE)
            w = tl.reshape(_dequantize(values, scale, mins, HAS_MINS), (BLOCK_N, BLOCK_K)).to(x.dtype)
            if GROUPED_ACT:  # the K tile lies in one activation group
                part = dot(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), x, w, DOT_F32, IEEE)
                acc += part * tl.load(xs_ptr + offs_m * n_act + (k0 >> act_shift), mask=m_mask, other=0.0)[:, None]
            else:
                acc = dot(acc, x, w, DOT_F32, IEEE)
    if ACT_Q and PER_TOKEN:
        acc *= tl.load(xs_ptr + offs_m * n_act, mask=m_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


# ----------------------------------------------------------------------------- host
def aligned_block_k(block_k: int, k: int, *groups: int) -> int:
    """A K tile within one group of each of ``groups`` (powers of two; 0 or >= k: no constraint)."""
    for group in groups:
        if 0 < group < k:
            block_k = min(block_k, group)
    return block_k


def _weight_args(w: QuantWeight, y: torch.Tensor) -> tuple:
    """The weight's tensors in the kernels' order (absent ones replaced by ``y``)."""
    return (w.data, w.scales, w.zeros if w.zeros is not None else y, w.mins if w.mins is not None else y)


def shift_of(group: int, k: int) -> int:
    """``log2(group)`` for a power-of-two group of columns (the kernels' ``column >> shift``); 31 where one group spans K."""
    return group.bit_length() - 1 if 0 < group < k else 31


def tiles_fit(w: QuantWeight, dtype: torch.dtype) -> bool:
    """Whether dots take quant_tiles.py's path (K tiles aligned to W's groups, one group each):
    16-bit models, groups of 64 columns or more (narrower ones: tiles dequantized across groups)."""
    return dtype in (torch.bfloat16, torch.float16) and (w.group_k >= w.k or w.group_k >= 64)


def _flags(w: QuantWeight, cfg: QuantLaunch, act_scales: Optional[torch.Tensor], act_group: int, y: torch.Tensor) -> dict:
    """The constexprs the quantized kernels share (here and fused_moe_quant.py)."""
    return dict(FP8=w.fp8, BITS=w.bits, HAS_ZEROS=w.zeros is not None, HAS_MINS=w.mins is not None,
                FP8_NATIVE=w.fp8 and cfg.fp8_native, PRMT=cfg.prmt and not interpreting(),
                ACT_Q=act_scales is not None, PER_TOKEN=act_group >= w.k,
                DOT_F32=interpreting(), IEEE=y.dtype == torch.float32 and not interpreting())


def _tile_args(w: QuantWeight, act_group: int, block_k: int, in_groups: bool) -> dict:
    """The two kernels' group shifts and K-tile constexprs (``in_groups``: quant_tiles.py's loop)."""
    return dict(group_shift=shift_of(w.group_k, w.k), act_shift=shift_of(act_group, w.k), TILES=in_groups,
                EVEN_K=w.k % block_k == 0, ONE_GROUP=w.group_k >= w.k and w.mins is None, BLOCK_K=block_k,
                GS_TILE=group_tile(block_k, w.group_k, w.k))


def run(x: torch.Tensor, w: QuantWeight, bias: Optional[torch.Tensor], cfg: QuantLaunch, out_dtype: torch.dtype,
        act_scales: Optional[torch.Tensor] = None, act_group: int = 0) -> torch.Tensor:
    """y = x @ W.T (+ bias) in ``out_dtype``. With ``act_scales`` [M, K / act_group] (fp8 W only:
    W8A8), x holds fp8 activations (their bytes without ``fp8_native``), one scale per
    ``act_group`` columns of a row (``act_group`` >= K: one per row)."""
    m, k = x.shape
    assert k == w.k, f"x has {k} columns, the weight {w.k}"
    y = torch.empty(m, w.n, dtype=out_dtype, device=x.device)
    if m == 0 or w.n == 0:
        return y
    if act_scales is None:
        act_group = k
    if cfg.gemv:
        return _gemv(x, w, bias, cfg, act_scales, act_group, y)
    return _gemm(x, w, bias, cfg, act_scales, act_group, y)


def _gemv(x: torch.Tensor, w: QuantWeight, bias: Optional[torch.Tensor], cfg: QuantLaunch,
          act_scales: Optional[torch.Tensor], act_group: int, y: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    xs = act_scales if act_scales is not None else y
    n = w.n
    assert m <= MAX_GEMV_ROWS and (cfg.use_dot or m == 1), f"the GEMV takes one row, or up to {MAX_GEMV_ROWS} with tl.dot"
    in_groups = cfg.use_dot and tiles_fit(w, y.dtype)
    block_k = aligned_block_k(cfg.block_k, k, act_group, w.group_k if in_groups else 0) if cfg.use_dot else cfg.block_k
    fp8_dot = in_groups and w.fp8 and act_scales is not None and cfg.fp8_dot and cfg.fp8_native and block_k >= 32
    tiles = cdiv(n, cfg.block_n)
    splits = cfg.splits or max(1, min(cdiv(cfg.waves * num_sms(x.device), tiles), cdiv(k, 2 * block_k)))
    k_per_split = cdiv(cdiv(k, splits), block_k) * block_k
    splits = cdiv(k, k_per_split)
    counters = split_counters(x.device, tiles) if splits > 1 else None
    if splits > 1 and counters is None:  # capture with too few counters: whole-K programs
        splits, k_per_split = 1, cdiv(k, block_k) * block_k
    block_m = max(16, next_pow2(m)) if cfg.use_dot else 1
    part = torch.empty(splits, block_m, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    pdl = cfg.pdl and pdl_supported(x.device)
    _gemv_kernel[(tiles, splits)](
        x, xs, *_weight_args(w, y), bias if bias is not None else y, y, part, counters if counters is not None else y,
        m, n, k, w.data.shape[1], w.scales.shape[1], k_per_split, w.zero_point, w.scale_bn,
        **_tile_args(w, act_group, block_k, in_groups), n_act=xs.shape[-1], **_flags(w, cfg, act_scales, act_group, y),
        stride_xm=x.stride(0), stride_wn=w.data.stride(0), stride_sn=w.scales.stride(0), stride_ym=y.stride(0),
        FP8_DOT=fp8_dot, HAS_BIAS=bias is not None, DIRECT=splits == 1, USE_DOT=cfg.use_dot, BLOCK_M=block_m,
        BLOCK_N=cfg.block_n, PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    return y


def _gemm(x: torch.Tensor, w: QuantWeight, bias: Optional[torch.Tensor], cfg: QuantLaunch,
          act_scales: Optional[torch.Tensor], act_group: int, y: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    n = w.n
    xs = act_scales if act_scales is not None else y
    fp8_dot = w.fp8 and act_scales is not None and cfg.fp8_dot
    assert cfg.fp8_native or not fp8_dot, "fp8 tensor-core GEMMs need hardware fp8 (fp8_native)"
    in_groups = tiles_fit(w, y.dtype) or fp8_dot
    block_k = aligned_block_k(cfg.block_k, k, act_group, w.group_k if in_groups else 0)
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
    _gemm_kernel[grid](
        x, xs, *_weight_args(w, y), bias if bias is not None else y, y,
        m, n, k, w.data.shape[1], w.scales.shape[1], w.zero_point, w.scale_bn,
        **_tile_args(w, act_group, block_k, in_groups), n_act=xs.shape[-1], **_flags(w, cfg, act_scales, act_group, y),
        stride_xm=x.stride(0), stride_wn=w.data.stride(0), stride_sn=w.scales.stride(0), stride_ym=y.stride(0),
        FP8_DOT=fp8_dot, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


__all__ = ["QuantLaunch", "QuantWeight", "MAX_GEMV_ROWS", "gemv_rows", "run", "fits_tiles", "group_tile", "aligned_block_k"]
