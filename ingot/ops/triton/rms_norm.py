"""RMSNorm and fused residual-add + RMSNorm over the last dimension.

Numerics follow ``reference.rms_norm``: the statistics in fp32, the normalized
value cast to the input dtype, then multiplied by the weight (as torch does a
bf16 x bf16 multiply: in fp32, rounded once). The fused variant first forms
``x + residual`` in the input dtype (rounded once, like torch) and normalizes
that.

Inputs may be strided in their leading dims (e.g. q [T, H, D] sliced out of a
fused qkv projection): rows are addressed as ``(row // inner) * s0 + (row %
inner) * s1`` and only the last dim must be contiguous. Each program handles
``BLOCK_R`` whole rows, so short rows (a per-head q/k norm) still give big
enough programs. ``head_rms_norm`` is the same normalization of one head held in registers as
its two rotary halves, for the fused decode attention (Qwen3's q/k norm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ingot.ops.triton._common import cuda_kernel, next_pow2

_ELEMS_PER_PROGRAM = 4096
_WEIGHT_FIRST_MAX_ROWS = 256  # decode batches


@dataclass(frozen=True)
class RmsNormConfig:
    """Launch parameters of the RMSNorm kernels (``launch_config`` picks them; sweeps and tests pass their own)."""

    block_r: int  # whole rows per program (a power of two)
    num_warps: int
    weight_first: bool  # load the weight before the row instead of after the reduction


@triton.jit
def head_norm_weights(w_ptr, offs_h, h_mask, HALF: tl.constexpr):
    """A per-head RMSNorm weight as its two rotary halves, fp32."""
    w1 = tl.load(w_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    return w1, w2


@triton.jit
def head_rms_norm(x1, x2, w1, w2, eps, HEAD_DIM: tl.constexpr):
    """RMSNorm of each head held as two halves (rows of ``x1``/``x2``, or one head as 1-D) with
    the weight's halves ``w1``/``w2``, computed as ``rms_norm``: fp32 mean of squares, the
    normalised value rounded to the input dtype, times the weight, rounded again (Qwen3's q/k
    norm, folded into the fused decode attention)."""
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    rstd = tl.rsqrt((tl.sum(f1 * f1, -1, keep_dims=True) + tl.sum(f2 * f2, -1, keep_dims=True)) / HEAD_DIM + eps)
    y1 = w1 * (f1 * rstd).to(x1.dtype).to(tl.float32)
    y2 = w2 * (f2 * rstd).to(x2.dtype).to(tl.float32)
    return y1.to(x1.dtype), y2.to(x2.dtype)


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr,
    num_rows, inner, eps,
    sx0, sx1, sr0, sr1, so0, so1, sq0, sq1,
    N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, WEIGHT_FIRST: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    r_mask = rows < num_rows
    c_mask = cols < N
    mask = r_mask[:, None] & c_mask[None, :]
    outer = rows // inner
    mid = rows % inner

    if WEIGHT_FIRST:
        # few rows (decode): the weight's load overlaps the row's instead of waiting for the reduction
        w = tl.load(w_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + (outer * sx0 + mid * sx1)[:, None] + cols[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + (outer * sr0 + mid * sr1)[:, None] + cols[None, :], mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + (outer * sq0 + mid * sq1)[:, None] + cols[None, :], s, mask=mask)
        h = s.to(tl.float32)
    else:
        h = x.to(tl.float32)
    var = tl.sum(h * h, 1) / N
    rstd = tl.rsqrt(var + eps)
    hn = (h * rstd[:, None]).to(dtype).to(tl.float32)
    if not WEIGHT_FIRST:
        w = tl.load(w_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
    y = w[None, :] * hn
    tl.store(
        out_ptr + (outer * so0 + mid * so1)[:, None] + cols[None, :],
        y.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A 3-D view [A, B, N] of ``t`` with a unit last stride (copies only if it must)."""
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() == 2:
        t = t.unsqueeze(1)
    elif t.dim() > 3:
        t = t.reshape(-1, t.shape[-2], t.shape[-1])
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        t = t.contiguous()
    return t


def launch_config(num_rows: int, n: int) -> RmsNormConfig:
    """About 4096 elements per program in whole rows (short rows: several per
    program), warps by program size. At 4096 x 3584 nothing among 1-4 rows per program
    x 4-16 warps beats it (``python -m benchmarks.kernels --sweep elementwise``), nor do
    streaming cache hints. The weight is loaded first for decode batches: a 1-row norm
    in a decode step takes about 12% less time, but at 4096 rows reaches 63% of copy
    bandwidth against 70-71% loading it last."""
    block_n = next_pow2(n)
    block_r = max(1, min(_ELEMS_PER_PROGRAM // block_n, next_pow2(num_rows)))
    elems = block_r * block_n
    num_warps = 4 if elems <= 2048 else (8 if elems <= 8192 else 16)
    return RmsNormConfig(block_r, num_warps, weight_first=num_rows <= _WEIGHT_FIRST_MAX_ROWS)


def _launch(x, residual, weight, eps, out, res_out, config: Optional[RmsNormConfig]):
    n = x.shape[-1]
    x3 = _as_rows(x)
    o3 = _as_rows(out)
    r3 = _as_rows(residual) if residual is not None else x3
    q3 = _as_rows(res_out) if res_out is not None else o3
    num_rows = x3.shape[0] * x3.shape[1]
    if num_rows == 0:
        return
    inner = x3.shape[1]
    cfg = config or launch_config(num_rows, n)
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    _rms_norm_kernel[(triton.cdiv(num_rows, cfg.block_r),)](
        x3, r3, weight, o3, q3,
        num_rows, inner, float(eps),
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        o3.stride(0), o3.stride(1), q3.stride(0), q3.stride(1),
        N=n, BLOCK_N=next_pow2(n), BLOCK_R=cfg.block_r,
        HAS_RESIDUAL=residual is not None,
        WEIGHT_FIRST=cfg.weight_first,
        num_warps=cfg.num_warps,
    )


def _fresh(x: torch.Tensor) -> torch.Tensor:
    """An output like ``x`` that ``_as_rows`` can view without copying."""
    out = torch.empty_like(x)
    if out.dim() > 3 and not out.is_contiguous():
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return out


@cuda_kernel
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, config: Optional[RmsNormConfig] = None) -> torch.Tensor:
    """Triton implementation of ``torch.ops.ingot.rms_norm``."""
    out = _fresh(x)
    _launch(x, None, weight, eps, out, None, config)
    return out


@cuda_kernel
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, config: Optional[RmsNormConfig] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of ``torch.ops.ingot.add_rms_norm``: (norm(x + r), x + r)."""
    out = _fresh(x)
    new_residual = _fresh(x)
    _launch(x, residual, weight, eps, out, new_residual, config)
    return out, new_residual
