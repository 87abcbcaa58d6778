"""int_linear on CUDA: int4 / int8 weights (the canonical int form) served at their own byte
count, unpacked tile by tile in registers (kernels: quant_gemm.py, quant_tiles.py).

At batch 1 a projection's time is reading its weight: int4 reads a quarter of bf16's bytes
(plus 2-3 bytes of scale and zero per group), so the GEMV's target is that byte count at
copy bandwidth, which leaves the K loop about 3.5 sm_90 instructions an int4 weight. More
rows go to the tiled GEMM, whose unpacking cost per weight is spread over the tile's rows.

Numerics: weights are ``(u - zero) * scale (+ min)`` in fp32, as the reference computes
them. With groups of 64 columns or more (16-bit models) every path dots ``u - zero``, exact
in bf16 / fp16, and scales the sums per K tile: the weights are never rounded (the reference
rounds them to the model dtype before its GEMM). Narrower groups: the GEMVs compute with
exact weights (one row: fp32 products), the GEMM rounds each weight as the reference does.
Sums in fp32, rounded once.
"""

from __future__ import annotations

from typing import Optional

import torch

from ingot.ops import reference as ref
from ingot.ops.triton._common import cuda_kernel, last_dim_contiguous
from ingot.ops.triton.pdl import pdl_supported
from ingot.ops.triton.quant_gemm import QuantLaunch, QuantWeight, fits_tiles, gemv_rows, run


WIDE_INT4_ROWS = 16384  # one int4 row: weights this tall go to the multiply-reduce (launch_config)


def launch_config(m: int, n: int, k: int, group_size: int, device: torch.device,
                  dtype: torch.dtype = torch.bfloat16, bits: int = 4) -> QuantLaunch:
    """Launch parameters for ``m`` rows (of ``dtype``) and an [n, k] ``bits``-bit weight with groups of ``group_size``.

    Chosen by counting the sm_90 instructions of the K loop per weight without a GPU
    (``benchmarks/quant_sass.py``; at batch 1 an int4 weight has about 3.5 to spend at HBM
    bandwidth, an int8 one 7), to be swept on the GPU (``benchmarks/quant_kernels.py --sweep``).
    16-bit rows, groups of 64 columns or more (``quant_gemm.tiles_fit``): every row count goes
    through tensor-core dots on exact values, K tiles of 128 in one group (quant_tiles.py),
    128 weight rows a program so that each warp's share of x (its columns permuted for int4)
    serves 32 rows: int4 2.7 instructions a weight from 1 to 16 rows (the one-row
    multiply-reduce costs 5.0), 3.5 at 32 and 64 rows (wgmma, x from shared memory); int8 per
    channel 3.6. One int4 row, as swept (H100, 7B shapes, int4 g128): two waves of programs
    (qkv / o / down 9.4 / 8.6 / 27.3 us against 10.4 / 9.4 / 28.2 with four), and for the
    widest weights (gate_up, 37,888 rows) the multiply-reduce over 64 rows x 256 columns,
    45.2 us against 52.2 for the dots. A split-K GEMV up to 64 rows while the GEMM's tiles would not fill the GPU
    (``gemv_rows``), then a GEMM: 64 x 128 tiles (128 x 128 spill), 128 x 128 where one group
    spans K. Narrower groups (GGUF's 16 and 32) dequantize tiles across groups: one row by the
    multiply-reduce (6.0), more by 64 x 128 dots. fp32 rows: IEEE dots on FMA units, small tiles.
    """
    pdl = pdl_supported(device)
    one_group = group_size >= k or group_size <= 0
    if dtype == torch.float32 or (group_size < 64 and not one_group):
        if m == 1:
            return QuantLaunch(True, False, 1, 64, 256, num_warps=4, num_stages=3, waves=4, pdl=pdl)
        if dtype == torch.float32:
            if m <= 16:
                return QuantLaunch(True, True, 16, 32, 32, num_warps=4, num_stages=3, waves=2, pdl=pdl)
            return QuantLaunch(False, True, 32, 64, 32, num_warps=4, num_stages=3)
        if gemv_rows(m, n, device):
            return QuantLaunch(True, True, 16, 64 if m <= 16 else 32, 128, num_warps=4, num_stages=3,
                               waves=2 if m <= 16 else 4, pdl=pdl)
        return QuantLaunch(False, True, 64 if m <= 64 else 128, 128, 64, num_warps=4 if m <= 64 else 8, num_stages=3)
    if m == 1 and bits == 4 and n >= WIDE_INT4_ROWS:
        return QuantLaunch(True, False, 1, 64, 256, num_warps=4, num_stages=3, waves=4, pdl=pdl)
    if m == 1 and bits == 8:
        return QuantLaunch(True, True, 16, 128, 128, num_warps=4, num_stages=3, waves=4, pdl=pdl)
    if m <= 16:
        return QuantLaunch(True, True, 16, 128, 128, num_warps=4, num_stages=3, waves=2, pdl=pdl)
    if gemv_rows(m, n, device):
        return QuantLaunch(True, True, 16, 128, 128, num_warps=4, num_stages=3, waves=4 if m <= 32 else 2, pdl=pdl)
    if m <= 64 or not one_group:
        return QuantLaunch(False, True, 64, 128, 128, num_warps=4, num_stages=3)
    return QuantLaunch(False, True, 128, 128, 128, num_warps=8, num_stages=3)


@cuda_kernel
def int_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
    mins: Optional[torch.Tensor], bias: Optional[torch.Tensor], bits: int, group_size: int, zero_point: int,
    config: Optional[QuantLaunch] = None,
) -> torch.Tensor:
    """Triton implementation of ``torch.ops.ingot.int_linear`` (x [M, K], qweight int32 [N, K * bits / 32])."""
    m, k = x.shape
    n = qweight.shape[0]
    assert bits in (4, 8) and qweight.shape[1] * (32 // bits) == k, \
        f"qweight {tuple(qweight.shape)} does not hold {k} {bits}-bit columns"
    if not fits_tiles(group_size, k):  # groups no power-of-two tile aligns with: no checkpoint format has them
        return ref.int_linear(x, qweight, scales, zeros, mins, bias, bits, group_size, zero_point)
    w = QuantWeight(
        qweight.contiguous(), scales.contiguous(), None if zeros is None else zeros.contiguous(),
        None if mins is None else mins.contiguous(), n, k, fp8=False, bits=bits, group_k=group_size,
        zero_point=zero_point,
    )
    cfg = config or launch_config(m, n, k, group_size, x.device, x.dtype, bits)
    return run(last_dim_contiguous(x), w, bias, cfg, x.dtype)


__all__ = ["int_linear", "launch_config"]
