"""fp8_linear on CUDA: float8 e4m3 weights with block scales, read as fp8 and converted in
registers (kernels: quant_gemm.py); W8A16, and W8A8 with dynamic activation scales.

W8A8 quantizes the activations first (``act_quant``: one small kernel, byte for byte the
reference's ``quantize_fp8_activations``): every path then reads fp8 activations, exact in
bf16, and applies their scales to the sums. Unrounded activations would differ from the
reference by 2-3% (e4m3 keeps 3 mantissa bits), beyond bf16 tolerance, so the GEMV computes
with the fp8 values too: on sm_89+ it dots them with the raw fp8 weight tiles, which spares
converting every weight (1.7 sm_90 instructions a weight against 3.8 converting both).

Paths, chosen by ``launch_config`` from shapes and device:

* few rows (a decode batch, up to 64 while the GEMM would not fill the GPU): the split-K
  GEMV on tensor cores from one row up, K tiles in one block, the sums scaled per tile
  (blocks of 64 columns or more, 16-bit models; else weights fp32 in registers, times
  their block's scale).
* more rows, W8A8 on sm_90+, per-token activations and per-tensor or per-channel weights
  (the layouts of ``torch._scaled_mm``'s rowwise scaling): ``torch._scaled_mm``, the bias
  added after it.
* more rows, W8A8 on sm_89+ otherwise (128 x 128 weight blocks, activations per token or
  per 128 columns: DeepSeek / Qwen3 FP8): the Triton GEMM on fp8 tensor cores, each K tile's
  fp32 product scaled by its activation and weight scales.
* more rows, W8A16 (or W8A8 where GPUs lack fp8 tensor cores: the fp8 activations in bf16
  math): the Triton GEMM on the tiles' fp8 values converted to x's dtype, scaled per K tile.

Numerics: products and sums in fp32 as the reference, except that the W8A16 GEMM over
blocks narrower than 64 columns rounds each weight (times its scale) to x's dtype; sums
rounded once (``_scaled_mm`` rounds before the bias is added).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import triton
import triton.language as tl

from ingot.ops import reference as ref
from ingot.ops.triton._common import capability, cuda_kernel, last_dim_contiguous, next_pow2
from ingot.ops.triton.pdl import pdl_supported
from ingot.ops.triton.quant_gemm import QuantLaunch, QuantWeight, aligned_block_k, fits_tiles, gemv_rows, run


# ----------------------------------------------------------------------------- W8A8 activations
@triton.jit
def _round_e4m3(v):
    """fp32 ``v`` (|v| <= 448) -> the nearest float8 e4m3fn value (ties to even), kept in fp32:
    3 mantissa bits by integer ops; below 2**-6 the subnormal step 2**-9 by adding 2**14 to |v|
    (the sign put back: negatives rounding to zero are -0, as torch's conversion gives)."""
    bits = v.to(tl.uint32, bitcast=True)
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    sub = ((tl.abs(v) + 16384.0) - 16384.0).to(tl.uint32, bitcast=True) | (bits & 0x80000000)
    return tl.where(tl.abs(v) < 0.015625, sub, normal).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits(r):
    """An e4m3fn value ``r`` (fp32, from ``_round_e4m3``) -> its byte."""
    bits = r.to(tl.uint32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    normal = (((mag >> 23) - 120) << 3) | ((mag >> 20) & 7)
    sub = (tl.abs(r) * 512.0).to(tl.uint32)
    return (((bits >> 24) & 0x80) | tl.where(mag < 0x3C800000, sub, normal)).to(tl.uint8)


@triton.jit
def _quantize_store(x, s, q_ptr, mask):
    """fp32 activations ``x`` divided by their scale ``s``, saturated and rounded to e4m3, stored as bytes."""
    tl.store(q_ptr, _e4m3_bits(_round_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, s), -448.0), 448.0))), mask=mask)


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, n_groups, group, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    """``reference.quantize_fp8_activations``: one program per row and group of ``group``
    columns; the scale is ``amax * (1 / 448)`` in fp32 (at least 1e-12), as the reference computes it. ``ONE_PASS``: the group fits one
    tile, kept in registers; else two passes over it (its amax, then the values)."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    lo = g * group
    hi = tl.minimum(lo + group, K)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    q_row = q_ptr + row.to(tl.int64) * K
    if ONE_PASS:
        cols = lo + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < hi, other=0.0).to(tl.float32)
        s = tl.maximum(tl.max(tl.abs(x), axis=0) * (1.0 / 448.0), 1e-12)
        _quantize_store(x, s, q_row + cols, cols < hi)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(lo, hi, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + cols, mask=cols < hi, other=0.0).to(tl.float32)))
        s = tl.maximum(tl.max(amax, axis=0) * (1.0 / 448.0), 1e-12)
        for c0 in range(lo, hi, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            _quantize_store(tl.load(x_row + cols, mask=cols < hi, other=0.0).to(tl.float32), s, q_row + cols, cols < hi)
    tl.store(s_ptr + row * n_groups + g, s)


ONE_PASS_MAX = 32768  # activation columns a quantizing program keeps in registers (16 warps: 64 a thread)


def act_quant(x: torch.Tensor, act_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.quantize_fp8_activations``: (float8 activations [M, K], fp32 scales [M, K / group])."""
    m, k = x.shape
    group = act_group or k
    assert k % group == 0, f"{k} columns do not split into groups of {group}"
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(m, k // group, dtype=torch.float32, device=x.device)
    if m and k:
        block = min(next_pow2(group), ONE_PASS_MAX)
        _act_quant_kernel[(m, k // group)](x, q.view(torch.uint8), scales, k, x.stride(0), k // group, group, BLOCK=block,
                                           ONE_PASS=group <= block, num_warps=max(1, min(16, block // 512)))
    return q, scales


# ----------------------------------------------------------------------------- the op
def scaled_mm_fits(n: int, k: int, block_n: int, block_k: int, act_group: int, dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm``'s rowwise scaling computes this layer: per-token activations,
    per-tensor or per-channel weights, bf16 out, dimensions multiples of 16."""
    per_tensor = (block_n == 0 or block_n >= n) and (block_k == 0 or block_k >= k)
    per_channel = block_n == 1 and (block_k == 0 or block_k >= k)
    return act_group == 0 and (per_tensor or per_channel) and dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0


def launch_config(m: int, n: int, k: int, block_n: int, block_k: int, act_group: int, device: torch.device,
                  dtype: torch.dtype = torch.bfloat16) -> QuantLaunch:
    """Launch parameters for ``m`` rows (of ``dtype``) and an [n, k] fp8 weight with
    ``block_n x block_k`` scale blocks and activations per ``act_group``.

    int_linear's tiles, chosen by counting the sm_90 instructions of the K loop per weight
    (``benchmarks/quant_sass.py``; an fp8 weight has about 7 to spend at HBM bandwidth), to be
    swept on the GPU (``benchmarks/quant_kernels.py --sweep``). 16-bit rows, blocks of 64
    columns or more: tensor-core dots from 1 row up (rows padded to 16), K tiles of 128 in one
    block, 128 weight rows a program; W8A8 dots the fp8 activations with the raw tiles (sm_89+:
    1.7 instructions a weight at 1 to 16 rows, 1.2 to 1.9 at 64, against 3.8 to 5.5 converting
    both to bf16), W8A16 converts the tile (3.6). A split-K GEMV up to 64 rows while the GEMM's
    tiles would not fill the GPU (``gemv_rows``), then GEMMs: W8A8 on fp8 tensor cores,
    rowwise layouts on sm_90+ by ``torch._scaled_mm``; W8A16 64 x 128 tiles (128 x 128 spill
    with block scales). fp32 rows and narrower blocks: one row by the multiply-reduce, small
    tiles (see int_linear).
    """
    native = capability(device) >= (8, 9)
    pdl = pdl_supported(device)
    fp8_dot = act_group >= 0 and native  # W8A8 on fp8 tensor cores
    narrow = 0 < block_k < min(64, k)
    if dtype == torch.float32 or narrow:
        if m == 1:
            return QuantLaunch(True, False, 1, 64, 256, num_warps=4, num_stages=3, waves=4, pdl=pdl, fp8_native=native)
        if m <= 16 or dtype == torch.float32:
            return QuantLaunch(m <= 16, True, 16 if m <= 16 else 32, 32 if dtype == torch.float32 else 64,
                               32 if dtype == torch.float32 else 64, num_warps=4, num_stages=3, waves=2, pdl=pdl,
                               fp8_native=native)
    elif m <= 16:
        return QuantLaunch(True, True, 16, 128, 128, num_warps=4, num_stages=3, waves=4 if m == 1 else 2, pdl=pdl,
                           fp8_native=native, fp8_dot=fp8_dot)
    scaled = fp8_dot and capability(device) >= (9, 0) and scaled_mm_fits(n, k, block_n, block_k, act_group, dtype)
    if gemv_rows(m, n, device) and not narrow:
        return QuantLaunch(True, True, 16, 128, 128, num_warps=4, num_stages=3, waves=4 if m <= 32 else 2, pdl=pdl,
                           fp8_native=native, fp8_dot=fp8_dot)
    block_m = 64 if m <= 64 else 128
    warps = 4 if block_m == 64 else 8
    if fp8_dot:
        return QuantLaunch(False, True, block_m, 128, 128, num_warps=warps, num_stages=3, fp8_native=True,
                           fp8_dot=True, scaled_mm=scaled)
    if narrow:
        return QuantLaunch(False, True, block_m, 128, 64, num_warps=warps, num_stages=3, fp8_native=native)
    return QuantLaunch(False, True, 64, 128, 128, num_warps=4, num_stages=3, fp8_native=native)


def _scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-token fp8 activations times per-tensor / per-channel fp8 weights by cuBLAS / CUTLASS."""
    q, scale_x = act_quant(x, 0)
    n = weight.shape[0]
    scale_w = weight_scale.float().reshape(1, -1).expand(1, n).contiguous()  # [1, N]: one scale per output
    y = torch._scaled_mm(q, weight.contiguous().t(), scale_a=scale_x, scale_b=scale_w, out_dtype=x.dtype)
    return y if bias is None else y + bias


@cuda_kernel
def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor],
    block_n: int, block_k: int, act_group: int, config: Optional[QuantLaunch] = None,
) -> torch.Tensor:
    """Triton implementation of ``torch.ops.ingot.fp8_linear`` (x [M, K], weight float8_e4m3fn [N, K])."""
    m, k = x.shape
    n = weight.shape[0]
    x = last_dim_contiguous(x)
    group_k = block_k or k
    if not fits_tiles(group_k, k) or (act_group > 0 and (k % act_group or not fits_tiles(act_group, k))):
        # groups no power-of-two tile aligns with: no checkpoint format has them
        return ref.fp8_linear(x, weight, weight_scale, bias, block_n, block_k, act_group)
    cfg = config or launch_config(m, n, k, block_n, block_k, act_group, x.device, x.dtype)
    if not cfg.gemv and act_group >= 0 and cfg.scaled_mm and m and scaled_mm_fits(n, k, block_n, block_k, act_group, x.dtype):
        return _scaled_mm(x, weight, weight_scale, bias)
    if cfg.fp8_dot and aligned_block_k(cfg.block_k, k, group_k, act_group) < 32:
        cfg = replace(cfg, fp8_dot=False)  # groups narrower than an fp8 dot's K
    w = QuantWeight(
        weight.contiguous() if cfg.fp8_native else weight.contiguous().view(torch.uint8), weight_scale.contiguous(),
        None, None, n, k, fp8=True, bits=8, group_k=group_k, scale_bn=block_n or n,
    )
    if act_group < 0:
        return run(x, w, bias, cfg, x.dtype)
    q, scales = act_quant(x, act_group)  # the kernels read fp8 activations and apply their scales to the sums
    return run(q if cfg.fp8_native else q.view(torch.uint8), w, bias, cfg, x.dtype, scales, act_group or k)


__all__ = ["fp8_linear", "launch_config", "scaled_mm_fits", "act_quant"]
