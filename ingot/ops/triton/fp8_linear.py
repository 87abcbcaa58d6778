"""fp8_linear on CUDA: float8 e4m3 weights with block scales, read as fp8 and converted in
registers (kernels: quant_gemm.py); W8A16 and W8A8 with dynamic activation scales.

Paths, chosen by ``launch_config`` from shapes and device:

* few rows (a decode batch): the split-K GEMV; weights become fp32 in registers, times
  their block's scale. W8A8 rounds the activations through fp8 in registers first (the
  amaxes come from one small kernel): at few rows fp8 tensor cores save nothing, but
  unrounded activations would differ from the reference by 2-3%.
* more rows, W8A8 on sm_90+, per-token activations and per-tensor or per-channel weights
  (the layouts of ``torch._scaled_mm``'s rowwise scaling): activations quantized by a
  Triton kernel, then ``torch._scaled_mm``; the bias added after it.
* more rows, W8A8 on sm_89+ otherwise (128 x 128 weight blocks, activations per token or
  per 128 columns: DeepSeek / Qwen3 FP8): the Triton GEMM on fp8 tensor cores, each K tile's
  fp32 product scaled by its activation and weight scales.
* more rows, W8A16 (or W8A8 where GPUs lack fp8 tensor cores: activations rounded through
  fp8 in registers, then bf16 math): the Triton GEMM with B tiles dequantized to x's dtype.

Numerics: products and sums in fp32 as the reference; the ``tl.dot`` paths of W8A16 round
each dequantized weight (and W8A8 activation) to x's dtype, the fp8 paths are exact
products. Sums in fp32, rounded once (``_scaled_mm`` rounds before the bias is added).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from ingot.ops import reference as ref
from ingot.ops.triton._common import capability, cuda_kernel, last_dim_contiguous
from ingot.ops.triton.pdl import pdl_supported
from ingot.ops.triton.quant_gemm import (
    MAX_GEMV_ROWS, QuantLaunch, QuantWeight, act_quant, aligned_block_k, fits_tiles, run,
)


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

    A first table, to be swept on the GPU (``benchmarks/quant_kernels.py --sweep``): the GEMV
    tiles of int_linear (one row: 32 x 256 fp8, 8 KB per iteration like skinny_gemm's bf16
    tiles); W8A8 GEMMs on fp8 tensor cores with 128-wide K tiles (one 128-block per tile),
    rowwise layouts on sm_90+ by ``torch._scaled_mm``; W8A16 GEMMs with 64-wide K tiles. All
    compile for sm_90 without spills (ptxas -v). fp32 rows: small tiles (see int_linear).
    """
    native = capability(device) >= (8, 9)
    pdl = pdl_supported(device)
    if m == 1:
        return QuantLaunch(True, False, 1, 32, 256, num_warps=4, num_stages=3, waves=4, pdl=pdl, fp8_native=native)
    if dtype == torch.float32:
        if m <= MAX_GEMV_ROWS:
            return QuantLaunch(True, True, 16, 32, 32, num_warps=4, num_stages=3, waves=2, pdl=pdl, fp8_native=native)
        return QuantLaunch(False, True, 32, 64, 32, num_warps=4, num_stages=3, fp8_native=native)
    if m <= MAX_GEMV_ROWS:
        return QuantLaunch(True, True, 16, 64, 128, num_warps=4, num_stages=3, waves=2, pdl=pdl, fp8_native=native)
    block_m = 64 if m <= 64 else 128
    warps = 4 if block_m == 64 else 8
    if act_group >= 0 and native:
        scaled = capability(device) >= (9, 0) and scaled_mm_fits(n, k, block_n, block_k, act_group, dtype)
        return QuantLaunch(False, True, block_m, 128, 128, num_warps=warps, num_stages=3, fp8_native=True,
                           fp8_dot=True, scaled_mm=scaled)
    return QuantLaunch(False, True, block_m, 128, 64, num_warps=warps, num_stages=3, fp8_native=native)


def _scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-token fp8 activations times per-tensor / per-channel fp8 weights by cuBLAS / CUTLASS."""
    q, scale_x = act_quant(x, 0)
    n = weight.shape[0]
    scale_w = weight_scale.float().reshape(1, -1).expand(1, n).contiguous()  # [1, N]: one scale per output
    y = torch._scaled_mm(q, weight.t(), scale_a=scale_x, scale_b=scale_w, out_dtype=x.dtype)
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
    return run(x, w, bias, cfg, act_group)


__all__ = ["fp8_linear", "launch_config", "scaled_mm_fits"]
