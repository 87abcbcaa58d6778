"""y = x @ W.T (+ b) for few rows (a decode batch): weight streaming with split-K, one launch.

At batch 1-16 a decode step's GEMMs are matrix-vector products: the time is
reading W once. On the H200 cuBLAS read the Qwen2.5-1.5B weights (3.09 GB) in
1.245 ms per step, 2.5 TB/s against a 4.2 TB/s copy: the small projections
(qkv 6 MB, o 5 MB) cannot fill 132 SMs with whole-K tiles, and the split-K
ones add a reduce kernel. Here each program streams a ``BLOCK_N x K/S`` slab
of W (``tl.dot`` with the rows padded to 16), ``S`` is picked so the grid
covers about two waves of SMs, and the last of a tile's ``S`` programs sums
the fp32 partials, adds the bias and writes the output (the counter pattern
of decode attention), so there is no second launch.

Opt-in and unmeasured on the GPU so far: ``EngineConfig.skinny_gemm_max_rows``
(0 = off) routes linear layers with at most that many rows here.
``benchmarks/kernels.py`` times it against ``torch.nn.functional.linear`` on
the 1.5B / 7B projections; keep it off unless that shows a win.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ingot.ops.triton._common import cdiv, interpreting, next_pow2, num_sms, split_counters

MAX_ROWS = 16  # the M side of tl.dot
# Optional override for tuning sweeps: BLOCK_N, BLOCK_K, num_warps, num_stages, waves, splits.
CONFIG_OVERRIDE: dict = {}


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, counter_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, DOT_F32: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_splits = tl.num_programs(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if USE_DOT:
            if DOT_F32:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(x, tl.trans(w))
        else:  # one row (BLOCK_M == 1): a multiply-reduce streams W without staging it for tensor cores
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
    mn_mask = m_mask[:, None] & n_mask[None, :]
    y_tile = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if DIRECT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_tile, acc.to(y_ptr.dtype.element_ty), mask=mn_mask)
    else:
        # partials [S, BLOCK_M, N] fp32; the tile's last program sums them
        part_tile = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_tile + pid_k * BLOCK_M * N, acc, mask=mn_mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        done = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == num_splits - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(0, num_splits):
                total += tl.load(part_tile + s * BLOCK_M * N, mask=mn_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_tile, total.to(y_ptr.dtype.element_ty), mask=mn_mask)
            tl.atomic_xchg(counter_ptr + pid_n, 0, sem="relaxed", scope="gpu")


def _config(n: int, k: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, splits, num_warps, num_stages): about ``waves`` programs per SM."""
    o = CONFIG_OVERRIDE
    block_n = o.get("BLOCK_N", 64)
    block_k = o.get("BLOCK_K", 128)
    tiles = cdiv(n, block_n)
    want = cdiv(o.get("waves", 2) * num_sms(device), tiles)
    splits = o.get("splits", max(1, min(want, cdiv(k, 2 * block_k))))
    return block_n, block_k, splits, o.get("num_warps", 4), o.get("num_stages", 4)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Triton implementation of ``torch.ops.ingot.skinny_linear`` (``x`` [M <= 16, K])."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS, f"skinny_linear takes at most {MAX_ROWS} rows, got {m}"
    assert weight.shape[1] == k and weight.stride(1) == 1, "weight must be [N, K] with K contiguous"
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_n, block_k, splits, num_warps, num_stages = _config(n, k, x.device)
    k_per_split = cdiv(cdiv(k, splits), block_k) * block_k
    splits = cdiv(k, k_per_split)
    counters = None if splits == 1 else split_counters(x.device, cdiv(n, block_n))
    if splits > 1 and counters is None:  # capture with too few counters: whole-K tiles
        splits, k_per_split = 1, cdiv(k, block_k) * block_k
    use_dot = m > 1 or CONFIG_OVERRIDE.get("dot", False)
    block_m = max(16, next_pow2(m)) if use_dot else 1
    part = torch.empty(splits, block_m, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    _skinny_gemm_kernel[(cdiv(n, block_n), splits)](
        x, weight, bias if bias is not None else y, y, part, counters if counters is not None else y,
        m, n, k, k_per_split,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, DIRECT=splits == 1, DOT_F32=interpreting(), USE_DOT=use_dot,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )
    return y


__all__ = ["skinny_linear", "MAX_ROWS", "CONFIG_OVERRIDE"]
