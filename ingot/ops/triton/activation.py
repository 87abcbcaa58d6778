"""The gated activations over the merged gate/up projection: ``silu_and_mul`` (silu(gate) * up)
and ``gelu_tanh_and_mul`` (Gemma's GeGLU), one kernel with the activation a constexpr.

Numerics follow the references under torch: the activation computed in fp32 and rounded
to the input dtype, then the product computed in fp32 and rounded. gelu's tanh is
``2 * sigmoid(2u) - 1``, so ``0.5 * g * (1 + tanh(u)) = g * sigmoid(2u)`` (Triton's core
language has no tanh on every backend, its interpreter included; ``softcap.py`` does the same).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ingot.ops.triton._common import cuda_kernel, next_pow2

_BLOCK = 1024
SILU, GELU_TANH = 0, 1  # activations


@triton.jit
def gate_activation(g, ACT: tl.constexpr):
    """silu(g) or gelu(g, tanh approximation) of fp32 ``g``, in fp32."""
    if ACT == 1:
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) * (g + 0.044715 g^3)
        return g * tl.sigmoid(2.0 * u)
    else:
        return g / (1.0 + tl.exp(-g))


@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr,
    stride_x, stride_o,
    I: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0)
    act = gate_activation(gate.to(tl.float32), ACT).to(gate.dtype).to(tl.float32)
    y = act * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, act: int) -> torch.Tensor:
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
    _act_and_mul_kernel[grid](
        x2, o2, x2.stride(0), o2.stride(0),
        I=half, BLOCK=block, ACT=act,
        num_warps=4 if block >= 512 else 2,
    )
    return out


@cuda_kernel
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton implementation of ``torch.ops.ingot.silu_and_mul``."""
    return _act_and_mul(x, SILU)


@cuda_kernel
def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton implementation of ``torch.ops.ingot.gelu_tanh_and_mul``."""
    return _act_and_mul(x, GELU_TANH)
