"""fused_moe_int / fused_moe_fp8 on CUDA: routed experts held quantized (the canonical int and
fp8 forms, stacked [E, ...]), dequantized tile by tile in registers, never a dense copy.

The launches of fused_moe.py, whose routing machinery they share (``_block_rows``, the
alignment, the per-token sums and their counters), chosen by the same table: **per pair**
for few tokens (two GEMV-like launches, the down one summing each token's pairs; PDL on
sm_90+), **grouped** for more (align, two ``tl.dot`` GEMMs over blocks of one expert, the
token sum). Grids are fixed by the token count, so a call is captured in a CUDA graph.
Weight tiles come from quant_gemm.py's loader (``_weight_tile``): int4 / int8 words
unpacked (``prmt`` on a GPU), fp8 bytes converted, a scale (zero, min) per run of
``GS_TILE`` columns.

* per pair: one row, quant_gemm's one-row GEMV without the K split (a multiply-reduce on
  exact weights, the scales applied per group to the partial sums);
* grouped: each tile dequantized to the model dtype (one rounding, as the reference) and
  dotted; fp8 W8A8 on fp8 tensor cores (sm_89+) dots fp8 activations with the raw fp8
  tiles, each K tile's sums scaled by its weight block's and its activations' scales.

W8A8 (fp8 with ``act_group`` >= 0): each projection's input rows are rounded through fp8
in registers exactly as ``reference.quantize_fp8_activations`` rounds them (per token: a
first pass over the row for its largest magnitude; per group: the K tile is the group), so
the activation quantization adds no launch.

Numerics: fused_moe.py's rounding points (gate/up and down sums rounded to the model dtype,
SiLU and the product as the reference rounds them, the routing weight in fp32, each token's
pairs summed in ascending expert order in fp32); the GEMMs round each dequantized weight to
the model dtype as the reference does, the one-row path computes with exact weights.
Expert biases and gpt-oss's clamped SwiGLU ride in the shared epilogues (fused_moe.py's
``epilogue_args``): MXFP4 experts are served here, as fp8 with 32-column scale blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ingot.ops import reference as ref
from ingot.ops.reference_quant import PLAIN, Epilogue
from ingot.ops.triton import fused_moe as dense
from ingot.ops.triton._common import capability, cdiv, cuda_kernel, next_pow2, split_counters
from ingot.ops.triton.fp8_linear import _round_e4m3
from ingot.ops.triton.fused_moe import (
    _block_rows, _store_activation, _store_pairs, _sum_kernel, _sum_when_last, _token_ids,
)
from ingot.ops.triton.pdl import pdl_supported, release_dependents, wait_for_producer
from ingot.ops.triton.quant_gemm import (
    QuantWeight, _dequantize, _flags, _weight_args, _weight_tile, fits_tiles, group_tile, shift_of,
)
from ingot.ops.triton.quant_tiles import dot
from ingot.ops.triton.rounding import round_to


@dataclass(frozen=True)
class QuantMoeLaunch:
    """How one quantized fused-MoE call runs: fused_moe.py's ``MoeLaunch`` fields, and the
    weight conversions (``quant_gemm.QuantLaunch``'s)."""

    grouped: bool
    block_m: int
    gate_up: tuple[int, int, int, int]  # BLOCK_N, BLOCK_K, num_warps, num_stages
    down: tuple[int, int, int, int]
    pdl: bool = False
    fp8_native: bool = False  # fp8: hardware conversions (sm_89+), else bit decoding
    fp8_dot: bool = False  # fp8 W8A8, grouped: fp8 tensor-core dots (needs fp8_native)
    prmt: bool = True  # int: unpack by prmt (GPU only), else by shifts and masks


def launch_config(num_experts: int, intermediate: int, tokens: int, device: torch.device, fp8: bool = False) -> QuantMoeLaunch:
    """fused_moe.py's table (path, block rows, tiles, PDL) with the quantized weights' conversions.

    A first table, to be swept on the GPU: the dense sweep's choices fit the quantized
    weights too, in that a per-pair program streams 256-column K tiles of 8-16 rows (int4:
    128 bytes a row, the 16-byte loads of quant_gemm) and a grouped program dequantizes a
    64 x 64 tile once for its 16-64 pairs."""
    base = dense.launch_config(num_experts, intermediate, tokens, device)
    native = fp8 and capability(device) >= (8, 9)
    return QuantMoeLaunch(base.grouped, base.block_m, base.gate_up, base.down, base.pdl, native, native)


# ----------------------------------------------------------------------------- device helpers
@triton.jit
def _fp8_value(x, s):
    """x / s saturated and rounded to e4m3 (in fp32): ``quantize_fp8_activations`` element by element."""
    return _round_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, s), -448.0), 448.0))


@triton.jit
def _fp8_scale(amax):
    """The W8A8 scale of activations whose largest magnitude is ``amax``: amax times fp32(1 / 448),
    at least 1e-12 (fp8_linear's ``_act_quant_kernel``, the same bits as the reference)."""
    return tl.maximum(amax * (1.0 / 448.0), 1e-12)


@triton.jit
def _token_scales(x_rows, row_mask, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each row's per-token W8A8 scale [BLOCK_M]: a pass over the row (x_rows: the rows' pointers)."""
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows[:, None] + offs_k[None, :], mask=row_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    return _fp8_scale(amax)


@triton.jit
def _x_tile(
    x_rows, row_mask, k0, K, s_tok, dtype: tl.constexpr, ACT_Q: tl.constexpr, PER_TOKEN: tl.constexpr,
    FP8_DOT: tl.constexpr, GROUPED: tl.constexpr, BLOCK_K: tl.constexpr, GS_TILE: tl.constexpr,
):
    """The rows' activations at columns ``k0 + [0, BLOCK_K)`` and their scales [BLOCK_M].
    Grouped: [BLOCK_M, BLOCK_K] in ``dtype`` (W8A8: the fp8 values, exact; fp8 with ``FP8_DOT``),
    the scales the tile's group's (per-token ones: ``s_tok``, applied to the sums at the end).
    Per pair: [1, NG, GS_TILE] in fp32, a group's W8A8 scale already applied."""
    NG: tl.constexpr = BLOCK_K // GS_TILE
    if GROUPED:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows[:, None] + offs_k[None, :], mask=row_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        if ACT_Q:
            xf = x.to(tl.float32)
            if not PER_TOKEN:  # the tile is one activation group
                s_tok = _fp8_scale(tl.max(tl.abs(xf), axis=1))
            q = _fp8_value(xf, s_tok[:, None])
            if FP8_DOT:
                x = q.to(tl.float8e4nv)
            else:
                x = q.to(dtype)
    else:
        cols = k0 + tl.arange(0, NG)[:, None] * GS_TILE + tl.arange(0, GS_TILE)[None, :]
        x = tl.load(x_rows[:, None, None] + cols[None, :, :], mask=(cols < K)[None, :, :], other=0.0).to(tl.float32)
        if ACT_Q:
            if PER_TOKEN:
                x = _fp8_value(x, s_tok[:, None, None])
            else:
                s = _fp8_scale(tl.max(tl.max(tl.abs(x), axis=2), axis=1))[:, None, None]
                x = _fp8_value(x, s) * s
    return x, s_tok


@triton.jit
def _product(
    acc, x, xs, w_ptr, s_ptr, z_ptr, mn_ptr, offs_n, n_mask, k0, K, KW, G, stride_wn, stride_sn, zero_point, scale_bn,
    group_shift, FP8: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr,
    FP8_NATIVE: tl.constexpr, PRMT: tl.constexpr, ACT_Q: tl.constexpr, PER_TOKEN: tl.constexpr, FP8_DOT: tl.constexpr,
    DOT_F32: tl.constexpr, IEEE: tl.constexpr, GROUPED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GS_TILE: tl.constexpr,
):
    """acc + x . W[offs_n, k0 : k0 + BLOCK_K] for one expert's weight W (``_x_tile``'s x and scales)."""
    GROUP_ACT: tl.constexpr = ACT_Q and not PER_TOKEN
    if FP8_DOT:  # the raw fp8 tile; the K tile lies in one weight block, its scale per row
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                    mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        s_w = tl.load(s_ptr + (offs_n // scale_bn) * stride_sn + (k0 >> group_shift), mask=n_mask, other=0.0)
        part = dot(tl.zeros(acc.shape, dtype=tl.float32), x, w, DOT_F32, False) * s_w[None, :]
        if GROUP_ACT:
            part = part * xs[:, None]
        acc += part
    else:
        values, scale, mins = _weight_tile(
            w_ptr, s_ptr, z_ptr, mn_ptr, offs_n, n_mask, k0, K, KW, G, stride_wn, stride_sn, zero_point, scale_bn, group_shift,
            FP8, BITS, HAS_ZEROS, HAS_MINS, FP8_NATIVE, PRMT, BLOCK_N, BLOCK_K, GS_TILE)
        if GROUPED:
            w = tl.reshape(_dequantize(values, scale, mins, HAS_MINS), (BLOCK_N, BLOCK_K)).to(x.dtype)
            if GROUP_ACT:
                acc += dot(tl.zeros(acc.shape, dtype=tl.float32), x, w, DOT_F32, IEEE) * xs[:, None]
            else:
                acc = dot(acc, x, w, DOT_F32, IEEE)
        else:  # one row: exact weights, the scales (and mins) applied per group of the sums
            sums = tl.sum(values * x, axis=2)
            if HAS_MINS:
                sums = sums * scale + mins * tl.sum(x, axis=2)
            else:
                sums = sums * scale
            acc += tl.sum(sums, axis=1)[None, :]
    return acc


@triton.jit
def _expert_sums(
    x_rows, row_mask, K, w_ptr, s_ptr, z_ptr, mn_ptr, w2_ptr, s2_off, offs_n, n_mask, KW, G, stride_wn, stride_sn,
    zero_point, scale_bn, group_shift, dtype: tl.constexpr, FP8: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
    HAS_MINS: tl.constexpr, FP8_NATIVE: tl.constexpr, PRMT: tl.constexpr, ACT_Q: tl.constexpr, PER_TOKEN: tl.constexpr,
    FP8_DOT: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr, GROUPED: tl.constexpr, TWO: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GS_TILE: tl.constexpr,
):
    """The rows' sums over K against one expert's weight at rows ``offs_n`` ([BLOCK_M, BLOCK_N],
    fp32, W8A8 scales applied), and with ``TWO`` against a second one sharing its activation tiles
    (gate and up: ``w2_ptr``, its scales ``s2_off`` past the first's)."""
    s_tok = tl.full([BLOCK_M], 1.0, tl.float32)
    if ACT_Q and PER_TOKEN:
        s_tok = _token_scales(x_rows, row_mask, K, BLOCK_M, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x, xs = _x_tile(x_rows, row_mask, k0, K, s_tok, dtype, ACT_Q, PER_TOKEN, FP8_DOT, GROUPED, BLOCK_K, GS_TILE)
        acc = _product(acc, x, xs, w_ptr, s_ptr, z_ptr, mn_ptr, offs_n, n_mask, k0, K, KW, G, stride_wn, stride_sn,
                       zero_point, scale_bn, group_shift, FP8, BITS, HAS_ZEROS, HAS_MINS, FP8_NATIVE, PRMT, ACT_Q, PER_TOKEN,
                       FP8_DOT, DOT_F32, IEEE, GROUPED, BLOCK_N, BLOCK_K, GS_TILE)
        if TWO:
            acc2 = _product(acc2, x, xs, w2_ptr, s_ptr + s2_off, z_ptr + s2_off, mn_ptr + s2_off, offs_n, n_mask, k0, K,
                            KW, G, stride_wn, stride_sn, zero_point, scale_bn, group_shift, FP8, BITS, HAS_ZEROS, HAS_MINS,
                            FP8_NATIVE, PRMT, ACT_Q, PER_TOKEN, FP8_DOT, DOT_F32, IEEE, GROUPED, BLOCK_N, BLOCK_K, GS_TILE)
    if ACT_Q and PER_TOKEN:
        acc *= s_tok[:, None]
        acc2 *= s_tok[:, None]
    return acc, acc2


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, mn_ptr, a_ptr, ids_ptr, sorted_ptr, block_expert_ptr, rs_ptr, bias_ptr, alpha, limit,
    P, H, I, KW, G, zero_point, scale_bn, group_shift, up_rows, stride_x, stride_we, stride_wn, stride_se, stride_sn,
    FP8: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr, FP8_NATIVE: tl.constexpr,
    PRMT: tl.constexpr, ACT_Q: tl.constexpr, PER_TOKEN: tl.constexpr, FP8_DOT: tl.constexpr, DOT_F32: tl.constexpr,
    IEEE: tl.constexpr, TOP_K: tl.constexpr, GROUPED: tl.constexpr, HAS_SCALE: tl.constexpr, BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GS_TILE: tl.constexpr, PDL: tl.constexpr,
    HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
):
    """a[p, n] = silu(x_t . gate_e[n]) * (x_t . up_e[n]) for the block's pairs, N tile ``pid 1``
    (fused_moe.py's ``_gate_up_kernel`` on quantized rows; up's scale rows start at ``up_rows``)."""
    wait_for_producer(PDL)  # the routing and the hidden states come from the previous kernels
    e, rows = _block_rows(ids_ptr, sorted_ptr, block_expert_ptr, GROUPED, BLOCK_M)
    if e >= 0:
        dtype = a_ptr.dtype.element_ty
        row_mask = rows < P
        tok = (rows // TOP_K).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        w_g = w_ptr + e.to(tl.int64) * stride_we
        s_off = e.to(tl.int64) * stride_se
        if HAS_SCALE:  # issued before the K loop, so its round trip overlaps the loop instead of following it
            row_scale = tl.load(rs_ptr + tok, mask=row_mask, other=0.0)[:, None]
        acc_g, acc_u = _expert_sums(
            x_ptr + tok * stride_x, row_mask, H, w_g, s_ptr + s_off, z_ptr + s_off, mn_ptr + s_off, w_g + I * stride_wn,
            up_rows * stride_sn, offs_n, n_mask, KW, G, stride_wn, stride_sn, zero_point, scale_bn, group_shift, dtype, FP8,
            BITS, HAS_ZEROS, HAS_MINS, FP8_NATIVE, PRMT, ACT_Q, PER_TOKEN, FP8_DOT, DOT_F32, IEEE, GROUPED, True,
            BLOCK_M, BLOCK_N, BLOCK_K, GS_TILE)
        release_dependents(PDL)  # the down projection may launch while the tiles finish
        if HAS_SCALE:
            acc_g *= row_scale
            acc_u *= row_scale
        _store_activation(a_ptr, rows, row_mask, offs_n, n_mask, acc_g, acc_u, I, bias_ptr + e.to(tl.int64) * 2 * I,
                          alpha, limit, dtype, BF16, HAS_BIAS, SWIGLU)


@triton.jit
def _down_kernel(
    a_ptr, w_ptr, s_ptr, z_ptr, mn_ptr, y_ptr, weights_ptr, ids_ptr, sorted_ptr, block_expert_ptr, out_ptr, counter_ptr,
    bias_ptr, P, H, I, KW, G, zero_point, scale_bn, group_shift, stride_we, stride_wn, stride_se, stride_sn,
    FP8: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr, FP8_NATIVE: tl.constexpr,
    PRMT: tl.constexpr, ACT_Q: tl.constexpr, PER_TOKEN: tl.constexpr, FP8_DOT: tl.constexpr, DOT_F32: tl.constexpr,
    IEEE: tl.constexpr, ROUND_PRODUCT: tl.constexpr, GROUPED: tl.constexpr, BF16: tl.constexpr, SUM_HERE: tl.constexpr,
    TOP_K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GS_TILE: tl.constexpr, PDL: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """y[p, n] = w_p * (a_p . down_e[n]) in fp32 for the block's pairs, N tile ``pid 1`` (fused_moe.py's
    ``_down_kernel`` on quantized rows). ``SUM_HERE`` (per pair): the last of a token's k programs
    on this tile also sums them into out."""
    wait_for_producer(PDL)  # the routing and the activations come from the previous kernels
    e, rows = _block_rows(ids_ptr, sorted_ptr, block_expert_ptr, GROUPED, BLOCK_M)
    if e >= 0:
        dtype = a_ptr.dtype.element_ty
        row_mask = rows < P
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        s_off = e.to(tl.int64) * stride_se
        # the epilogue's operands, issued before the K loop so their round trips overlap it
        weight = tl.load(weights_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        if SUM_HERE:  # one pair a program: its token's expert ids, for the sum
            t = tl.program_id(0) // TOP_K
            ids = _token_ids(ids_ptr, t, TOP_K, K_POW2)
        acc, _ = _expert_sums(
            a_ptr + rows.to(tl.int64) * I, row_mask, I, w_ptr + e.to(tl.int64) * stride_we, s_ptr + s_off, z_ptr + s_off,
            mn_ptr + s_off, w_ptr, 0, offs_n, n_mask, KW, G, stride_wn, stride_sn, zero_point, scale_bn, group_shift, dtype,
            FP8, BITS, HAS_ZEROS, HAS_MINS, FP8_NATIVE, PRMT, ACT_Q, PER_TOKEN, FP8_DOT, DOT_F32, IEEE, GROUPED, False,
            BLOCK_M, BLOCK_N, BLOCK_K, GS_TILE)
        release_dependents(PDL)  # the next kernel may launch while the token sums run
        _store_pairs(acc, weight, y_ptr, rows, row_mask, offs_n, n_mask, H, dtype, BF16, ROUND_PRODUCT,
                     bias_ptr + e.to(tl.int64) * H, HAS_BIAS)
        if SUM_HERE:
            _sum_when_last(counter_ptr, t, ids, y_ptr, out_ptr, offs_n, n_mask, H, TOP_K, K_POW2, BF16)


# ----------------------------------------------------------------------------- host
@cuda_kernel
def fused_moe_int(
    hidden: torch.Tensor, gate_up_qweight: torch.Tensor, gate_up_scales: torch.Tensor,
    gate_up_zeros: Optional[torch.Tensor], gate_up_mins: Optional[torch.Tensor], down_qweight: torch.Tensor,
    down_scales: torch.Tensor, down_zeros: Optional[torch.Tensor], down_mins: Optional[torch.Tensor],
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, bits: int, group_size: int, zero_point: int,
    row_scale: Optional[torch.Tensor] = None, gate_up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None, swiglu_alpha: float = 0.0, swiglu_limit: float = 0.0,
    launch: Optional[QuantMoeLaunch] = None,
) -> torch.Tensor:
    """Triton implementation of ``torch.ops.ingot.fused_moe_int``; ``launch`` overrides the table."""
    tail = (gate_up_bias, down_bias, swiglu_alpha, swiglu_limit)
    h = hidden.shape[1]
    inter = down_qweight.shape[-1] * 32 // bits
    if not (fits_tiles(group_size or h, h) and fits_tiles(group_size or inter, inter)):
        # groups no power-of-two tile aligns with: no checkpoint format has them
        return ref.fused_moe_int(hidden, gate_up_qweight, gate_up_scales, gate_up_zeros, gate_up_mins, down_qweight,
                                 down_scales, down_zeros, down_mins, topk_weights, topk_ids, bits, group_size, zero_point,
                                 row_scale, *tail)

    def weight(q, s, z, m, n: int, k: int) -> QuantWeight:
        return QuantWeight(q.contiguous(), s.contiguous(), None if z is None else z.contiguous(),
                           None if m is None else m.contiguous(), n, k, fp8=False, bits=bits, group_k=group_size or k,
                           zero_point=zero_point)

    launch = launch or launch_config(down_qweight.shape[0], inter, hidden.shape[0], hidden.device)
    return run(hidden, weight(gate_up_qweight, gate_up_scales, gate_up_zeros, gate_up_mins, 2 * inter, h),
               weight(down_qweight, down_scales, down_zeros, down_mins, h, inter), topk_weights, topk_ids, launch,
               row_scale, epilogue=Epilogue(*tail))


@cuda_kernel
def fused_moe_fp8(
    hidden: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
    down_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, block_n: int, block_k: int,
    act_group: int, row_scale: Optional[torch.Tensor] = None, gate_up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None, swiglu_alpha: float = 0.0, swiglu_limit: float = 0.0,
    launch: Optional[QuantMoeLaunch] = None,
) -> torch.Tensor:
    """Triton implementation of ``torch.ops.ingot.fused_moe_fp8``; ``launch`` overrides the table.
    MXFP4 experts (``block_n`` 1, ``block_k`` 32) take the kernels whenever both widths divide by 32."""
    tail = (gate_up_bias, down_bias, swiglu_alpha, swiglu_limit)
    h, inter = hidden.shape[1], down.shape[-1]
    fits = fits_tiles(block_k or h, h) and fits_tiles(block_k or inter, inter)
    if act_group > 0:  # each K tile one activation group
        fits = fits and act_group & (act_group - 1) == 0 and h % act_group == 0 and inter % act_group == 0
    if not fits:
        return ref.fused_moe_fp8(hidden, gate_up, gate_up_scale, down, down_scale, topk_weights, topk_ids, block_n,
                                 block_k, act_group, row_scale, *tail)
    launch = launch or launch_config(down.shape[0], inter, hidden.shape[0], hidden.device, fp8=True)

    def weight(w: torch.Tensor, s: torch.Tensor, n: int, k: int, parts: int) -> QuantWeight:
        data = w.contiguous() if launch.fp8_native else w.contiguous().view(torch.uint8)
        return QuantWeight(data, s.contiguous(), None, None, n, k, fp8=True, bits=8, group_k=block_k or k,
                           scale_bn=block_n or n // parts)

    return run(hidden, weight(gate_up, gate_up_scale, 2 * inter, h, 2), weight(down, down_scale, h, inter, 1),
               topk_weights, topk_ids, launch, row_scale, act_group, Epilogue(*tail))


def _weight_launch(w: QuantWeight, launch: QuantMoeLaunch, tile: tuple[int, int, int, int], act_group: int,
                   a: torch.Tensor) -> tuple[tuple, dict]:
    """One projection's weight arguments and constexprs: its K tile (one activation group for
    W8A8 per group; fp8 dots only where it lies in one weight block). ``a``, in the model dtype,
    stands in for absent tensors (and tells quant_gemm's flags the dtype)."""
    block_n, block_k, warps, stages = tile
    act = act_group >= 0
    if act and 0 < act_group < w.k:
        block_k = act_group
    fp8_dot = launch.fp8_dot and launch.fp8_native and launch.grouped and act and block_k >= 32 and (
        w.group_k >= w.k or block_k <= w.group_k)
    flags = _flags(w, launch, a if act else None, act_group if 0 < act_group < w.k else w.k, a)
    args = (*_weight_args(w, a), w.data.shape[-1], w.scales.shape[-1], w.zero_point, w.scale_bn, shift_of(w.group_k, w.k))
    return args, dict(flags, FP8_DOT=fp8_dot, BLOCK_N=block_n, BLOCK_K=block_k,
                      GS_TILE=group_tile(block_k, w.group_k, w.k), num_warps=warps, num_stages=stages)


def run(
    hidden: torch.Tensor, gate_up: QuantWeight, down: QuantWeight, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    launch: QuantMoeLaunch, row_scale: Optional[torch.Tensor] = None, act_group: int = -1,
    epilogue: Epilogue = PLAIN,
) -> torch.Tensor:
    """The launches of one call (fused_moe.py's ``run`` on quantized weights, stacked [E, ...];
    up's scale rows follow gate's, half of gate_up's)."""
    t, h = hidden.shape
    experts, inter, top_k = gate_up.data.shape[0], down.k, topk_ids.shape[1]
    out = torch.empty(t, h, dtype=hidden.dtype, device=hidden.device)
    if t == 0:
        return out
    pairs = t * top_k
    x = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    ids = topk_ids.contiguous().view(-1)
    weights = topk_weights.contiguous().view(-1)
    a = torch.empty(pairs, inter, dtype=hidden.dtype, device=hidden.device)
    y = torch.empty(pairs, h, dtype=torch.float32, device=hidden.device)
    m_blocks, sorted_ids, block_expert = _align(ids, experts, pairs, launch)
    pdl = launch.pdl and pdl_supported(hidden.device)
    common = dict(BF16=hidden.dtype == torch.bfloat16, GROUPED=launch.grouped, TOP_K=top_k, BLOCK_M=launch.block_m,
                  PDL=pdl, launch_pdl=pdl)
    gu_args, down_args, gu_consts, down_consts = dense.epilogue_args(epilogue, a)
    args, consts = _weight_launch(gate_up, launch, launch.gate_up, act_group, a)
    _gate_up_kernel[(m_blocks, cdiv(inter, consts["BLOCK_N"]))](
        x, *args[:4], a, ids, sorted_ids, block_expert, row_scale.contiguous() if row_scale is not None else ids,
        *gu_args, pairs, h, inter, *args[4:], gate_up.scales.shape[1] // 2, x.stride(0), gate_up.data.stride(0),
        gate_up.data.stride(1), gate_up.scales.stride(0), gate_up.scales.stride(1),
        **consts, **common, **gu_consts, HAS_SCALE=row_scale is not None,
    )
    args, consts = _weight_launch(down, launch, launch.down, act_group, a)
    k_pow2 = max(2, next_pow2(top_k))
    # per pair, the down kernel sums each token's pairs itself (one counter per token and tile)
    counters = None if launch.grouped else split_counters(hidden.device, t * cdiv(h, consts["BLOCK_N"]))
    _down_kernel[(m_blocks, cdiv(h, consts["BLOCK_N"]))](
        a, *args[:4], y, weights, ids, sorted_ids, block_expert, out, counters if counters is not None else ids,
        *down_args, pairs, h, inter, *args[4:], down.data.stride(0), down.data.stride(1), down.scales.stride(0),
        down.scales.stride(1), **consts, **common, **down_consts, ROUND_PRODUCT=topk_weights.dtype == hidden.dtype,
        SUM_HERE=counters is not None, K_POW2=k_pow2,
    )
    if counters is None:
        _sum_kernel[(t, cdiv(h, dense._SUM_BLOCK))](
            y, ids, out, h, TOP_K=top_k, K_POW2=k_pow2, BF16=common["BF16"], BLOCK=dense._SUM_BLOCK, num_warps=2,
        )
    return out


def _align(ids: torch.Tensor, experts: int, pairs: int, launch: QuantMoeLaunch) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(blocks, sorted pair ids, block experts) of the grouped path (fused_moe.py's ``_align_kernel``);
    per pair one block a pair, the ids standing in for the unused lists."""
    if not launch.grouped:
        return pairs, ids, ids
    bm = launch.block_m
    m_blocks = cdiv(pairs + min(experts, pairs) * (bm - 1), bm)
    sorted_ids = torch.empty(m_blocks * bm, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(m_blocks, dtype=torch.int32, device=ids.device)
    dense._align_kernel[(experts,)](
        ids, sorted_ids, block_expert, pairs, m_blocks, BLOCK_M=bm, CHUNK=min(dense._ALIGN_CHUNK, next_pow2(pairs)),
        E_BINS=next_pow2(experts), BLOCK_B=next_pow2(cdiv(pairs, bm)), num_warps=4,
    )
    return m_blocks, sorted_ids, block_expert


__all__ = ["fused_moe_int", "fused_moe_fp8", "run", "launch_config", "QuantMoeLaunch"]
