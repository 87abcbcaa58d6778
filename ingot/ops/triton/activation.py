"""silu_and_mul: silu(x[..., :I]) * x[..., I:] over the merged gate/up projection.

Numerics follow ``reference.silu_and_mul`` under torch: silu computed in fp32
and rounded to the input dtype, then the product computed in fp32 and rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ingot.ops.triton._common import cuda_kernel, next_pow2

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr,
    stride_x, stride_o,
    I: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    y = act * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@cuda_kernel
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton implementation of ``torch.ops.ingot.silu_and_mul``."""
    width = x.shape[-1]
    half = width // 2
    out = torch.empty(*x.shape[:-1], half, dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    o2 = out.view(-1, half)
    rows = x2.shape[0]
    if rows == 0 or half == 0:
        return out
    block = min(_BLOCK, next_pow2(half))
    grid = (rows, triton.cdiv(half, block))
    _silu_and_mul_kernel[grid](
        x2, o2, x2.stride(0), o2.stride(0),
        I=half, BLOCK=block,
        num_warps=4 if block >= 512 else 2,
    )
    return out
