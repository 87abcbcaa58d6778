"""Inputs and checks shared by the int_linear / fp8_linear kernel tests (GPU and interpreter);
imports no Triton.

Each check compares a kernel with the reference op computed in fp32 from the same inputs
(the weights dequantized exactly, fp32 products and sums): relative L2 error below ``tol``
(bf16 outputs 1e-2, as the other kernel tests; fp32 1e-5), NaN never passing. W8A8 checks
also require the error to stay below 0.4 times the gap between the W8A8 and W8A16 references
(about 2-3%; the kernels' error is rounding to bf16, a few 0.1%), so a kernel that
skipped rounding its activations through fp8 fails.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ingot.ops import reference as ref
from tests.ops.kernel_cases import rel_err

# 7B projections (N, K), as benchmarks/kernels_skinny.py lists them
PROJECTIONS_7B = dict(qkv=(4608, 3584), o=(3584, 3584), gate_up=(37888, 3584), down=(3584, 18944))


def tol_for(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


def _on(gen: torch.Generator) -> dict:
    return dict(generator=gen, device=gen.device)


def int_weight(n: int, k: int, bits: int, group_size: int, zeros: bool, mins: bool, gen: torch.Generator,
               scale_dtype: torch.dtype = torch.float16) -> list:
    """(qweight, scales, zeros, mins) of a random [n, k] int weight on ``gen``'s device, scaled
    so that outputs stay O(1); mins (GGUF's Q4_1 form) pair with the implicit zero point 0."""
    qweight = ref.pack_int(torch.randint(0, 2**bits, (n, k), dtype=torch.int32, **_on(gen)), bits)
    g = -(-k // group_size)
    step = 1.0 / (2 ** (bits - 1) * k**0.5)
    scales = ((torch.rand(n, g, **_on(gen)) + 0.5) * step).to(scale_dtype)
    zero_pts = torch.randint(0, 2**bits, (n, g), dtype=torch.int32, **_on(gen)).to(torch.uint8) if zeros else None
    min_vals = (-(2 ** (bits - 1)) * step * (torch.rand(n, g, **_on(gen)) + 0.5)).to(scale_dtype) if mins else None
    return [qweight, scales, zero_pts, min_vals]


def int_case(
    m: int, n: int, k: int, bits: int, group_size: int, zeros: bool, mins: bool, bias: bool, dtype: torch.dtype,
    gen: torch.Generator, scale_dtype: torch.dtype = torch.float16, weight: Optional[list] = None,
) -> list:
    """Arguments of ``int_linear`` on ``gen``'s device (``weight``: one from ``int_weight`` to reuse).
    With mins the implicit zero point is 0, else 2 ** (bits - 1)."""
    weight = weight or int_weight(n, k, bits, group_size, zeros, mins, gen, scale_dtype)
    x = torch.randn(m, k, **_on(gen)).to(dtype)
    b = torch.randn(n, **_on(gen)).to(dtype) if bias else None
    return [x, *weight, b, bits, group_size, 0 if mins else 2 ** (bits - 1)]


def fp8_weight(n: int, k: int, block_n: int, block_k: int, gen: torch.Generator) -> list:
    """(weight, weight_scale): fp8 values over e4m3's range (subnormals included), one fp32
    scale per ``block_n x block_k`` block (0: the whole dimension)."""
    weight = (torch.randn(n, k, **_on(gen)) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    gn, gk = -(-n // (block_n or n)), -(-k // (block_k or k))
    return [weight, (torch.rand(gn, gk, **_on(gen)) + 0.5) / (64 * k**0.5)]


def fp8_case(
    m: int, n: int, k: int, block_n: int, block_k: int, act_group: int, bias: bool, dtype: torch.dtype,
    gen: torch.Generator, weight: Optional[list] = None,
) -> list:
    """Arguments of ``fp8_linear`` on ``gen``'s device (``weight``: one from ``fp8_weight`` to reuse)."""
    weight = weight or fp8_weight(n, k, block_n, block_k, gen)
    x = torch.randn(m, k, **_on(gen)).to(dtype)
    b = torch.randn(n, **_on(gen)).to(dtype) if bias else None
    return [x, *weight, b, block_n, block_k, act_group]


def _fp32(args: list) -> list:
    return [a.float() if isinstance(a, torch.Tensor) and a.dtype in (torch.bfloat16, torch.float16) else a for a in args]


def int_expected(args: list) -> torch.Tensor:
    x, qweight, scales, zeros, mins, bias = _fp32(args[:6])
    return ref.int_linear(x, qweight, scales, zeros, mins, bias, *args[6:])


def fp8_expected(args: list, act_group: Optional[int] = None) -> torch.Tensor:
    """The fp32 reference; ``act_group`` overrides the case's (-1: the W8A16 result)."""
    x, weight, weight_scale, bias = _fp32(args[:4])
    group = args[6] if act_group is None else act_group
    return ref.fp8_linear(x, weight, weight_scale, bias, args[4], args[5], group)


def check_int_linear(fn: Callable, args: list, tol: Optional[float] = None) -> float:
    """Run ``fn`` (an int_linear implementation) on ``args`` against the fp32 reference; the error."""
    out = fn(*args)
    x = args[0]
    assert out.dtype == x.dtype and out.shape == (x.shape[0], args[1].shape[0])
    err = rel_err(out, int_expected(args))
    assert err < (tol or tol_for(x.dtype)), err
    return err


def check_fp8_linear(fn: Callable, args: list, tol: Optional[float] = None) -> float:
    """Run ``fn`` (an fp8_linear implementation) on ``args`` against the fp32 reference; the error.
    W8A8: also well below the W8A8 reference's own distance from W8A16 (activations rounded)."""
    out = fn(*args)
    x = args[0]
    assert out.dtype == x.dtype and out.shape == (x.shape[0], args[1].shape[0])
    expected = fp8_expected(args)
    err = rel_err(out, expected)
    assert err < (tol or tol_for(x.dtype)), err
    if args[6] >= 0 and x.shape[0]:
        gap = rel_err(fp8_expected(args, -1), expected)
        assert err < 0.4 * gap, (err, gap)
    return err
