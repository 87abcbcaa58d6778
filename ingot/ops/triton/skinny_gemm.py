"""y = x @ W.T (+ b) for few rows (a decode batch): weight streaming with split-K, one launch.

At batch 1-16 a decode step's GEMMs are matrix-vector products: the time is
reading W once. cuBLAS reads the Qwen2.5-1.5B weights (3.09 GB) at about 60% of
copy bandwidth per step: the small projections (qkv 6 MB, o 5 MB) cannot fill
a hundred-odd SMs with whole-K tiles, and the split-K ones add a reduce kernel.
Here each program streams a ``BLOCK_N x K/S`` slab of W, ``S`` is picked so the
grid covers a few waves of SMs, and the last of a tile's ``S`` programs sums the
fp32 partials, adds the bias and writes the output (the counter pattern of
decode attention), so there is no second launch. One row uses a multiply-reduce
(a tensor-core tile would be 15/16 padding); more rows use ``tl.dot`` with the
rows padded to 16.

Prologues fold the elementwise op in front of a projection into its load of
``x``, which removes that op's launch (the point at batch 1, where each launch
costs more than its bytes):

* ``rms_norm_linear``: ``x + residual``, RMSNorm, then the GEMM; the programs of
  the first N tile also write the new residual. ``rstd`` needs the whole row,
  so it is applied after the sum, ``y = rstd * sum(W * (norm_w * s))``: each
  program sums squares over its own K range while it streams, and the tile's
  merging program (or a whole-K program) adds them up. A first pass over the
  row in every program instead would cost more per GEMV than the launch it
  saves.
* ``rms_norm_linear_scaled``: the same, and the GEMV's own input for a second consumer
  (a MoE layer's experts, after its router): ``norm_w * s``, which the first tile's
  programs write as they stream it, and each row's ``rstd``, which its merging program
  writes with the output. The consumer scales its sums by ``rstd`` as this GEMV does
  (``fused_moe``'s ``row_scale``), so the norm's own launch goes and nothing waits for
  a normed row to be written.
* ``silu_mul_linear`` / ``gelu_tanh_mul_linear``: ``act(gate) * up`` of a merged gate/up
  output (SiLU, or Gemma's GeGLU: the activation a constexpr), then the GEMM.

One epilogue: ``linear_norm_linear_scaled`` is a projection joining the residual
stream (attention's o_proj) followed by a MoE layer's ``rms_norm_linear_scaled``,
in one launch for one row. Each tile's merging program adds the residual, writes
``s`` and ``norm_w * s`` for its columns and leaves its share of the router's sums
(its columns of the router, loaded while the tile's splits finish) and of the sum
of squares; the grid's last tile adds the shares up in tile order (deterministic)
and writes the logits and rstd. The router's GEMV then has no launch of its own,
and no program waits on a whole normed row.

On sm_90+ every launch uses programmatic dependent launch (``pdl.py``): a program
loads the weight-only epilogue operands, waits for the previous kernel, streams its
slab and releases the next kernel before its split-K merge and epilogue.

Rounding: the activations round like the reference ops, so its GEMM sees the
unfused path's input bit for bit. The norm rounds ``x + residual`` and
``norm_w * s`` to the model dtype but scales by ``rstd`` in fp32 after the
sum, where the reference rounds ``s * rstd`` first: a difference at the
level of bf16 rounding, within the GEMM's own tolerance. Roundings to bf16
use ``rounding.round_to`` (integer ops; the inline-asm ``cvt`` form makes the
batch-1 step 1-2% slower here).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from ingot.ops.triton._common import cdiv, cuda_kernel, interpreting, next_pow2, num_sms, split_counters
from ingot.ops.triton.activation import gate_activation
from ingot.ops.triton.pdl import pdl_supported, release_dependents, wait_for_producer
from ingot.ops.triton.rounding import round_to

MAX_ROWS = 16  # the M side of tl.dot
MAX_ROUTER_ROWS = 256  # experts a router epilogue holds (a tile's router columns live in registers)
NONE, NORM, SILU, GELU_TANH = 0, 1, 2, 3  # prologues


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch parameters of the skinny GEMM (``launch_config`` picks them; sweeps and tests pass their own)."""

    use_dot: bool  # tl.dot on rows padded to 16, else a one-row multiply-reduce
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    waves: int  # programs aimed at per SM when choosing the split count
    splits: Optional[int] = None  # K splits; None: from ``waves``
    # router epilogue: fp32 shares (tiles x experts) the last tile loads per round, in registers
    # (``launch_config`` gives 8,192 with the router: the Qwen3-30B-A3B o_proj's 64 x 128 in one round)
    share_block: int = 4096
    # programmatic dependent launch (``pdl.py``): start during the previous kernel's tail
    pdl: bool = False


@triton.jit
def _router_epilogue(
    out, w_router, res, nw, offs_n, n_mask, pid_n, done_ptr, r_out_ptr, xw_ptr, ss_ptr, lp_ptr,
    logits_ptr, rstd_ptr, eps, N, E,
    BF16: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """One row's tile ``out`` [1, BLOCK_N] (fp32) of a projection joining the residual stream,
    then that row's RMSNorm and router (``linear_norm_linear_scaled``). The tile adds the
    residual, writes the new residual ``s`` and ``norm_w * s``, and leaves its share of the
    router's sums and of the sum of squares in ``lp`` [tiles, E] / ``ss`` [tiles]; the grid's
    last tile adds the shares up in tile order and writes the logits, scaled by rstd, and rstd.
    ``res`` and ``nw``: the tile's columns of the residual and the norm weight, loaded by the
    caller before its K loop."""
    dtype = r_out_ptr.dtype.element_ty
    o = out.to(dtype).to(tl.float32)  # the projection's output, rounded as the unfused GEMV stores it
    s = round_to(o + res[None, :], dtype, BF16)
    tl.store(r_out_ptr + offs_n[None, :], s.to(dtype), mask=n_mask[None, :])
    hw = round_to(nw[None, :] * s, dtype, BF16)
    tl.store(xw_ptr + offs_n[None, :], hw.to(dtype), mask=n_mask[None, :])
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    tl.store(lp_ptr + pid_n * E + offs_e, tl.sum(w_router * hw, axis=1), mask=e_mask)
    tl.store(ss_ptr + pid_n + tl.arange(0, 1), tl.sum(s * s, axis=1))
    tl.debug_barrier()  # every thread's share is written before the release below
    tiles = tl.num_programs(0)
    done = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tiles - 1:
        logits = tl.zeros([BLOCK_E], dtype=tl.float32)
        sumsq = tl.zeros([1], dtype=tl.float32)
        for p0 in range(0, tiles, BLOCK_P):  # in tile order, whichever tile is last: deterministic
            offs_p = p0 + tl.arange(0, BLOCK_P)
            p_mask = offs_p < tiles
            shares = tl.load(lp_ptr + offs_p[:, None] * E + offs_e[None, :], mask=p_mask[:, None] & e_mask[None, :],
                             other=0.0, cache_modifier=".cg")
            logits += tl.sum(shares, axis=0)
            sumsq += tl.sum(tl.load(ss_ptr + offs_p, mask=p_mask, other=0.0, cache_modifier=".cg"), axis=0)
        rstd = tl.rsqrt(sumsq / N + eps)
        tl.store(logits_ptr + offs_e, (logits * rstd).to(logits_ptr.dtype.element_ty), mask=e_mask)
        tl.store(rstd_ptr + tl.arange(0, 1), rstd)
        tl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, counter_ptr,
    r_ptr, nw_ptr, r_out_ptr, ss_ptr, xw_ptr, rstd_ptr, eps,
    rw_ptr, lp_ptr, E,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_ym, stride_rm,
    HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, DOT_F32: tl.constexpr, USE_DOT: tl.constexpr,
    PROLOGUE: tl.constexpr, WRITE_SCALED: tl.constexpr, ROUTER: tl.constexpr, BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr, PDL: tl.constexpr,
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
    r_rows = r_ptr + offs_m[:, None] * stride_rm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    # the epilogue's operands (the bias; the router epilogue's residual and norm-weight columns),
    # issued before the K loop so their round trips overlap it instead of following it
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    res = tl.zeros([BLOCK_N], dtype=tl.float32)
    nw_cols = tl.zeros([BLOCK_N], dtype=tl.float32)
    if ROUTER:
        nw_cols = tl.load(nw_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    wait_for_producer(PDL)  # from here on, what the previous kernels wrote
    if ROUTER:
        res = tl.load(r_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)  # of x + residual over this program's K range
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        mk = m_mask[:, None] & k_mask[None, :]
        x = tl.load(x_rows + offs_k[None, :], mask=mk, other=0.0)
        if PROLOGUE == 1:  # x <- (x + residual) * norm weight; the row's rstd scales the sum at the end
            s = round_to(x.to(tl.float32) + tl.load(r_rows + offs_k[None, :], mask=mk, other=0.0).to(tl.float32),
                         x.dtype, BF16)
            if pid_n == 0:
                tl.store(r_out_ptr + offs_m[:, None] * stride_rm + offs_k[None, :], s.to(x.dtype), mask=mk)
            sumsq += tl.sum(s * s, axis=1)
            nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            x = round_to(nw[None, :] * s, x.dtype, BF16).to(x.dtype)
            if WRITE_SCALED and pid_n == 0:  # the experts' input, to be scaled by rstd as here
                tl.store(xw_ptr + offs_m[:, None] * stride_rm + offs_k[None, :], x, mask=mk)
        elif PROLOGUE >= 2:  # x <- act(gate) * up (SILU: silu, GELU_TANH: gelu), rounded as activation.py does
            g = x.to(tl.float32)
            up = tl.load(x_rows + K + offs_k[None, :], mask=mk, other=0.0).to(tl.float32)
            act = round_to(gate_activation(g, PROLOGUE - 2), x.dtype, BF16)
            x = round_to(act * up, x.dtype, BF16).to(x.dtype)
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if USE_DOT:
            if DOT_F32:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(x, tl.trans(w))
        else:  # one row (BLOCK_M == 1): a multiply-reduce streams W without staging it for tensor cores
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
    release_dependents(PDL)  # the next kernel may launch while the merges and epilogues run
    mn_mask = m_mask[:, None] & n_mask[None, :]
    y_tile = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    offs_e = tl.arange(0, BLOCK_E)
    w_router = tl.zeros([BLOCK_E, BLOCK_N], dtype=tl.float32)
    if ROUTER:  # this tile's columns of the router, loaded while the tile's other splits finish
        w_router = tl.load(rw_ptr + offs_e[:, None] * N + offs_n[None, :],
                           mask=(offs_e < E)[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
    if DIRECT:
        if PROLOGUE == 1:
            rstd = tl.rsqrt(sumsq / K + eps)
            acc *= rstd[:, None]
            if WRITE_SCALED and pid_n == 0:
                tl.store(rstd_ptr + offs_m, rstd, mask=m_mask)
        if HAS_BIAS:
            acc += bias[None, :]
        if ROUTER:
            _router_epilogue(acc, w_router, res, nw_cols, offs_n, n_mask, pid_n, counter_ptr + tl.num_programs(0),
                             r_out_ptr, xw_ptr, ss_ptr, lp_ptr, y_ptr, rstd_ptr, eps, N, E, BF16, BLOCK_E, BLOCK_P)
        else:
            tl.store(y_tile, acc.to(y_ptr.dtype.element_ty), mask=mn_mask)
    else:
        # partials [S, BLOCK_M, N] fp32; the tile's last program sums them
        part_tile = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_tile + pid_k * BLOCK_M * N, acc, mask=mn_mask)
        if PROLOGUE == 1:  # and the partial sums of squares [tiles, S, BLOCK_M]
            tl.store(ss_ptr + (pid_n * num_splits + pid_k) * BLOCK_M + offs_m, sumsq)
        tl.debug_barrier()  # every thread's partial is written before the release below
        done = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == num_splits - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            row_sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
            for s in range(0, num_splits):  # one loop, so both loads of a split are in flight together
                total += tl.load(part_tile + s * BLOCK_M * N, mask=mn_mask, other=0.0, cache_modifier=".cg")
                if PROLOGUE == 1:  # summed in split order, whichever program merges: deterministic
                    row_sumsq += tl.load(ss_ptr + (pid_n * num_splits + s) * BLOCK_M + offs_m, cache_modifier=".cg")
            if PROLOGUE == 1:
                rstd = tl.rsqrt(row_sumsq / K + eps)
                total *= rstd[:, None]
                if WRITE_SCALED and pid_n == 0:
                    tl.store(rstd_ptr + offs_m, rstd, mask=m_mask)
            if HAS_BIAS:
                total += bias[None, :]
            if ROUTER:
                _router_epilogue(total, w_router, res, nw_cols, offs_n, n_mask, pid_n,
                                 counter_ptr + tl.num_programs(0), r_out_ptr, xw_ptr, ss_ptr, lp_ptr, y_ptr, rstd_ptr,
                                 eps, N, E, BF16, BLOCK_E, BLOCK_P)
            else:
                tl.store(y_tile, total.to(y_ptr.dtype.element_ty), mask=mn_mask)
            tl.atomic_xchg(counter_ptr + pid_n, 0, sem="relaxed", scope="gpu")


def launch_config(m: int, n: int, k: int, device: torch.device, prologue: int = NONE, router: bool = False) -> SkinnyConfig:
    """Launch parameters for ``m`` rows of ``x`` and an [n, k] weight.

    From the sweep over the 1.5B projections (``python -m benchmarks.kernels --sweep skinny``):
    one row 16/256/4 warps/4 waves multiply-reduce, more rows 64/64/4 warps/2 waves ``tl.dot``.
    One row with a prologue: 32-wide tiles, so half as many programs recompute it (whole
    1.5B / 7B batch-1 steps 4% / 5% faster than 16-wide; 64 and 128 wide are slower at both
    shapes).
    ``router``: a projection with the router epilogue (``linear_norm_linear_scaled``): 32-row
    tiles, half as many shares for the last tile to add, which it loads in 8,192-float rounds.
    Qwen3-30B-A3B batch 1, compiled, that kernel a layer: 8,192-float rounds take 0.90x the
    time of 4,096 at 16 rows, 32 rows 0.83x that again (0.97x the step back to back; 64 rows
    0.8% slower than 32; Mixtral-8x7B's graph step 0.996x at 32 rows); 16,384-float rounds
    are no faster inside the step. ``ingot bench decode --shape qwen3-30b-a3b --batch-sizes 1
    --decode-compile on --profile 5`` lists the kernel's time per layer.
    """
    pdl = pdl_supported(device)
    if m > 1:
        return SkinnyConfig(use_dot=True, block_n=64, block_k=64, num_warps=4, num_stages=4, waves=2, pdl=pdl)
    block_n = 16 if prologue == NONE and not router else 32
    one_row = SkinnyConfig(use_dot=False, block_n=block_n, block_k=256, num_warps=4, num_stages=4, waves=4, pdl=pdl)
    return replace(one_row, share_block=8192) if router else one_row


def _launch(
    x: torch.Tensor, k: int, weight: torch.Tensor, bias: Optional[torch.Tensor],
    prologue: int = NONE, residual: Optional[torch.Tensor] = None, norm_weight: Optional[torch.Tensor] = None,
    eps: float = 0.0, config: Optional[SkinnyConfig] = None, write_scaled: bool = False,
    router_weight: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """y [M, N], and for the norm prologue the new residual, and with ``write_scaled`` the
    GEMV's input ``norm_w * s`` and each row's rstd; ``x`` holds ``K`` (SILU, GELU_TANH: 2K) columns.
    With ``router_weight`` [E, N] (one row, no prologue: ``linear_norm_linear_scaled``): the
    router's logits [1, E], the new residual, ``norm_w * s`` and rstd of y + residual."""
    m = x.shape[0]
    n = weight.shape[0]
    assert m <= MAX_ROWS, f"skinny GEMMs take at most {MAX_ROWS} rows, got {m}"
    assert weight.shape[1] == k and weight.stride(1) == 1, "weight must be [N, K] with K contiguous"
    if x.stride(1) != 1:
        x = x.contiguous()
    router = router_weight is not None
    y = torch.empty(m, router_weight.shape[0] if router else n, dtype=out_dtype or x.dtype, device=x.device)
    r_out = xw = rstd = None
    if prologue == NORM or router:  # residual rows, the new residual and the scaled input share one (contiguous) stride
        residual = residual.contiguous()
        r_out = torch.empty(m, n if router else k, dtype=x.dtype, device=x.device)
        if write_scaled or router:
            xw = torch.empty_like(r_out)
            rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        if r_out is not None:
            r_out.copy_(x + residual)
        if xw is not None:  # no GEMM to fold them into
            xw.copy_(norm_weight * r_out)
            rstd.copy_(torch.rsqrt(r_out.float().pow(2).mean(-1) + eps))
        return y, r_out, xw, rstd
    cfg = config or launch_config(m, n, k, x.device, prologue)
    assert cfg.use_dot or m == 1, "the multiply-reduce form takes one row"
    assert not router or (m == 1 and not cfg.use_dot and prologue == NONE), "the router epilogue takes one row"
    use_dot, block_n, block_k = cfg.use_dot, cfg.block_n, cfg.block_k
    tiles = cdiv(n, block_n)
    splits = cfg.splits or max(1, min(cdiv(cfg.waves * num_sms(x.device), tiles), cdiv(k, 2 * block_k)))
    k_per_split = cdiv(cdiv(k, splits), block_k) * block_k
    splits = cdiv(k, k_per_split)
    # one counter per tile for its splits; the router epilogue's last-tile counter after them
    needed = tiles + 1 if router else (tiles if splits > 1 else 0)
    counters = split_counters(x.device, needed) if needed else None
    if needed and counters is None:  # capture with too few counters
        assert not router, "linear_norm_linear_scaled needs its counters allocated before a capture"
        splits, k_per_split = 1, cdiv(k, block_k) * block_k  # whole-K tiles
    block_m = max(16, next_pow2(m)) if use_dot else 1
    part = torch.empty(splits, block_m, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    partial_sumsq = y
    if router:  # each tile's share of the router's sums and of the sum of squares
        shares = torch.empty(tiles, router_weight.shape[0], dtype=torch.float32, device=x.device)
        partial_sumsq = torch.empty(tiles, dtype=torch.float32, device=x.device)
    elif splits > 1 and prologue == NORM:
        partial_sumsq = torch.empty(tiles * splits * block_m, dtype=torch.float32, device=x.device)
    experts = router_weight.shape[0] if router else 1
    block_e = next_pow2(experts)
    pdl = cfg.pdl and pdl_supported(x.device)
    _skinny_gemm_kernel[(tiles, splits)](
        x, weight, bias if bias is not None else y, y, part, counters if counters is not None else y,
        residual if residual is not None else x, norm_weight if norm_weight is not None else x,
        r_out if r_out is not None else y, partial_sumsq,
        xw if xw is not None else y, rstd if rstd is not None else y, eps,
        router_weight.contiguous() if router else y, shares if router else y, experts,
        m, n, k, k_per_split,
        x.stride(0), weight.stride(0), y.stride(0), k,
        HAS_BIAS=bias is not None, DIRECT=splits == 1, DOT_F32=interpreting(), USE_DOT=use_dot,
        PROLOGUE=prologue, WRITE_SCALED=write_scaled, ROUTER=router, BF16=x.dtype == torch.bfloat16,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_E=block_e,
        BLOCK_P=max(1, min(next_pow2(tiles), cfg.share_block // block_e)),
        PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    return y, r_out, xw, rstd


@cuda_kernel
def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: Optional[torch.dtype] = None,
    config: Optional[SkinnyConfig] = None,
) -> torch.Tensor:
    """Triton implementation of ``torch.ops.ingot.skinny_linear`` (``x`` [M <= 16, K]; y in ``out_dtype``,
    default x's: the fp32 sums are stored as they are or rounded once)."""
    return _launch(x, x.shape[1], weight, bias, NONE, config=config, out_dtype=out_dtype)[0]


@cuda_kernel
def rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: Optional[torch.Tensor], config: Optional[SkinnyConfig] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of ``torch.ops.ingot.rms_norm_linear``."""
    return _launch(x, x.shape[1], weight, bias, NORM, residual, norm_weight, eps, config=config)[:2]


@cuda_kernel
def rms_norm_linear_scaled(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: Optional[torch.Tensor], config: Optional[SkinnyConfig] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton implementation of ``torch.ops.ingot.rms_norm_linear_scaled``."""
    return _launch(x, x.shape[1], weight, bias, NORM, residual, norm_weight, eps, config=config, write_scaled=True)


@cuda_kernel
def linear_norm_linear_scaled(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
    norm_weight: torch.Tensor, eps: float, router_weight: torch.Tensor, config: Optional[SkinnyConfig] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton implementation of ``torch.ops.ingot.linear_norm_linear_scaled``: one launch for
    one row; more rows (or none) run the projection and ``rms_norm_linear_scaled`` in turn."""
    cfg = config or launch_config(x.shape[0], weight.shape[0], x.shape[1], x.device, router=True)
    one_launch = x.shape[0] == 1 and not cfg.use_dot and weight.shape[0] > 0 and router_weight.shape[0] <= MAX_ROUTER_ROWS
    # one launch also needs its last-tile counter, which a graph capture cannot allocate
    if not one_launch or split_counters(x.device, cdiv(weight.shape[0], cfg.block_n) + 1) is None:
        y = skinny_linear(x, weight, bias, config=cfg)
        return rms_norm_linear_scaled(y, residual, norm_weight, eps, router_weight, None)
    return _launch(x, x.shape[1], weight, bias, NONE, residual, norm_weight, eps, cfg, router_weight=router_weight)


@cuda_kernel
def silu_mul_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], config: Optional[SkinnyConfig] = None
) -> torch.Tensor:
    """Triton implementation of ``torch.ops.ingot.silu_mul_linear`` (``x`` [M, 2K] gate | up)."""
    return _launch(x, x.shape[1] // 2, weight, bias, SILU, config=config)[0]


@cuda_kernel
def gelu_tanh_mul_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], config: Optional[SkinnyConfig] = None
) -> torch.Tensor:
    """Triton implementation of ``torch.ops.ingot.gelu_tanh_mul_linear`` (``x`` [M, 2K] gate | up)."""
    return _launch(x, x.shape[1] // 2, weight, bias, GELU_TANH, config=config)[0]


__all__ = ["skinny_linear", "rms_norm_linear", "rms_norm_linear_scaled", "linear_norm_linear_scaled", "silu_mul_linear", "gelu_tanh_mul_linear", "launch_config", "SkinnyConfig", "MAX_ROWS"]
