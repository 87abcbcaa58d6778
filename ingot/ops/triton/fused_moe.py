"""fused_moe: the experts of a mixture-of-experts layer for routed tokens, graph-safe.

A token and one of its top-k experts form a *pair*; pair ``p`` is token ``p // k``,
slot ``p % k`` (``topk_ids`` flattened). Per pair the layer computes
``y_p = w_p * down_e(silu(gate_e(x)) * up_e(x))``; per token it sums its ``k`` pairs.
Every launch has a grid fixed by the number of tokens (no host sync, nothing sized
by the routing), so a call is captured in a CUDA graph like any other op.

Two paths, chosen by ``launch_config`` from a table keyed by (experts, width,
tokens) and device:

* **per pair** (few tokens: a decode batch of 1..~4): one program per (pair, N
  tile), GEMV-like (a multiply-reduce over K, no tensor-core padding), reading
  only the chosen experts' weight rows; no sorting, no padding. Two launches:
  gate/up + SiLU-and-mul -> ``a [P, I]``; down -> ``y [P, H]`` (fp32, weighted),
  where the last of a token's k programs on an N tile (a counter per token and
  tile) also adds up the token's k rows of that tile.
* **grouped** (more tokens): ``_align_kernel`` lists each expert's pairs (in pair
  order) padded to a multiple of ``BLOCK_M``, at the expert's offset in one
  sorted list, and the expert of each block; the two GEMM kernels then run
  ``tl.dot`` over blocks of ``BLOCK_M`` pairs of one expert, so each expert's
  weights are read once per block instead of once per pair. The grid is the
  largest block count the routing can produce; blocks past the real count exit.
  Four launches (the per-token sum its own).

On sm_90+ the per-pair launches use programmatic dependent launch (``pdl.py``): each
kernel waits for its producer before reading the routing, and releases its successor
after its K loop.

gpt-oss's experts add a bias to each projection's output and replace SiLU-and-mul with the
clamped SwiGLU (``reference_quant.Epilogue``): constexprs of the two epilogues
(``HAS_BIAS``, ``SWIGLU``), so the other models' kernels compile as before.

An optional ``row_scale`` [T] multiplies each token's gate/up sums before they are
rounded: a MoE layer's router GEMV hands over ``norm_w * s`` and the norm's rstd
(``skinny_gemm.rms_norm_linear_scaled`` / ``linear_norm_linear_scaled``), so the norm needs no
launch of its own.

Numerics follow ``reference.fused_moe``: gate/up and down outputs rounded to the
model dtype, SiLU then the product rounded as the reference op rounds them, the
routing weight applied in fp32 (rounded to the model dtype when the weights are
in it, as the reference's product is; roundings by ``rounding.round_to``, so the
interpreter rounds as a GPU does), and each token's pairs summed in fp32 in
ascending expert order, the order the reference adds them. GEMM accumulation
order differs from cuBLAS, so results agree to bf16 rounding, not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from ingot.ops.reference_quant import PLAIN, Epilogue
from ingot.ops.triton._common import cdiv, cuda_kernel, interpreting, next_pow2, split_counters
from ingot.ops.triton.pdl import pdl_supported, release_dependents, wait_for_producer
from ingot.ops.triton.rounding import round_to


@dataclass(frozen=True)
class MoeLaunch:
    """How one fused_moe call runs: the path and its tile sizes."""

    grouped: bool  # False: one program per pair (GEMV); True: align + tl.dot over blocks of one expert
    block_m: int  # pairs per block (grouped; tl.dot needs >= 16); 1 per pair
    gate_up: tuple[int, int, int, int]  # BLOCK_N, BLOCK_K, num_warps, num_stages
    down: tuple[int, int, int, int]
    # programmatic dependent launch of both GEMMs (``pdl.py``; ``launch_config`` sets it where supported)
    pdl: bool = False


PER_PAIR = MoeLaunch(False, 1, (16, 256, 4, 4), (16, 256, 4, 4))
# one token over 128 experts of 768 (Qwen3-30B-A3B): 8-row gate/up tiles, a layer about 7% faster than
# with 16-row ones in two sweeps (``python benchmarks/fused_moe_sweep.py``); more tokens keep PER_PAIR
# (within 1%)
PER_PAIR_NARROW = MoeLaunch(False, 1, (8, 256, 4, 4), (16, 256, 4, 4))
# one token over 8 experts of 14336 (Mixtral-8x7B): the down projection (K = 14336) in 8-row tiles
# of 512 columns, a 2-3% faster graph step than PER_PAIR's 16 x 256, timed inside the step; timed
# the same way, no variant beats the other shapes' table launches
PER_PAIR_LONG_K = MoeLaunch(False, 1, (16, 256, 4, 4), (8, 512, 4, 4))


def _grouped(block_m: int, block_n: int = 64, block_k: int = 64, warps: int = 4, stages: int = 3) -> MoeLaunch:
    return MoeLaunch(True, block_m, (block_n, block_k, warps, stages), (block_n, block_k, warps, stages))


_ANY = 1 << 62
# device kind -> (experts, expert width) -> ((most tokens, launch), ...): the first row that covers the call.
# The per-pair path re-reads an expert once per token routed to it, the grouped one pays two extra
# launches: per pair while its expected extra reads under uniform routing, (k*T - distinct experts
# hit) * expert bytes, stay under ~16 MB (about what an sm_90 GPU reads in the time of two launches).
_TABLE: dict[str, dict[tuple[int, int], tuple[tuple[int, MoeLaunch], ...]]] = {
    "sm90": {
        (128, 768): ((1, PER_PAIR_NARROW), (4, PER_PAIR), (64, _grouped(16)), (256, _grouped(32)), (_ANY, _grouped(64))),  # Qwen3-30B-A3B
        (60, 1408): ((3, PER_PAIR), (64, _grouped(16)), (256, _grouped(32)), (_ANY, _grouped(64))),  # Qwen1.5-MoE-A2.7B
        (64, 1024): ((2, PER_PAIR), (64, _grouped(16)), (256, _grouped(32)), (_ANY, _grouped(64))),  # OLMoE-1B-7B
        (8, 14336): ((1, PER_PAIR_LONG_K), (16, _grouped(16)), (64, _grouped(32)), (_ANY, _grouped(64))),  # Mixtral-8x7B
    },
}
_DEFAULT_ROWS = ((2, PER_PAIR), (64, _grouped(16)), (256, _grouped(32)), (_ANY, _grouped(64)))


def _device_kind(device: torch.device) -> str:
    if device.type != "cuda":
        return "sm90"  # the interpreter (tests) follows the sm_90 table's choices
    major, _ = torch.cuda.get_device_capability(device)
    return f"sm{major}0"


def launch_config(num_experts: int, intermediate: int, tokens: int, device: torch.device) -> MoeLaunch:
    """The launch of a fused_moe call: from the table of ``device``'s kind for (experts, width),
    the first row covering ``tokens`` (a pure lookup: the same answer at warm-up and capture)."""
    rows = _TABLE.get(_device_kind(device), _TABLE["sm90"]).get((num_experts, intermediate), _DEFAULT_ROWS)
    launch = next(launch for most, launch in rows if tokens <= most)
    # PDL on the per-pair path only: the grouped one follows its own align kernel, launched as usual
    return replace(launch, pdl=pdl_supported(device) and not launch.grouped)


@triton.jit
def _align_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, P, max_blocks,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_BINS: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Program ``e``: expert e's pair ids (ascending) then padding ``P`` up to a multiple of
    BLOCK_M, at offset sum(padded counts of experts < e); e as the expert of those blocks.
    Program 0 also marks the blocks past the last expert's with -1."""
    e = tl.program_id(0)
    bins = tl.arange(0, E_BINS)
    counts = tl.zeros([E_BINS], dtype=tl.int32)
    for c0 in range(0, P, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        valid = offs < P
        ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
        counts += tl.histogram(ids, E_BINS, mask=valid)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(bins < e, padded, 0), axis=0)
    count = tl.sum(tl.where(bins == e, counts, 0), axis=0)
    count_padded = tl.sum(tl.where(bins == e, padded, 0), axis=0)
    seen = tl.full([], 0, tl.int32)
    for c0 in range(0, P, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        valid = offs < P
        hit = (tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int32) == e) & valid
        rank = seen + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        tl.store(sorted_ptr + start + rank, offs, mask=hit)
        seen += tl.sum(hit.to(tl.int32), axis=0)
    pad = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + start + count + pad, P, mask=pad < count_padded - count)
    blocks = tl.arange(0, BLOCK_B)
    tl.store(block_expert_ptr + start // BLOCK_M + blocks, e, mask=blocks < count_padded // BLOCK_M)
    if e == 0:
        total = tl.sum(padded, axis=0) // BLOCK_M
        for b0 in range(0, max_blocks, BLOCK_B):
            b = b0 + blocks
            tl.store(block_expert_ptr + b, -1, mask=(b >= total) & (b < max_blocks))


@triton.jit
def _block_rows(ids_ptr, sorted_ptr, block_expert_ptr, GROUPED: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, pair ids [BLOCK_M]) of this program's block: a sorted block, or one pair."""
    pid_m = tl.program_id(0)
    if GROUPED:
        e = tl.load(block_expert_ptr + pid_m)
        rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    else:
        e = tl.load(ids_ptr + pid_m).to(tl.int32)
        rows = pid_m + tl.arange(0, BLOCK_M)
    return e, rows


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, a_ptr, ids_ptr, sorted_ptr, block_expert_ptr, scale_ptr, bias_ptr, alpha, limit,
    P, H, I, stride_x, stride_we, stride_wn,
    TOP_K: tl.constexpr, GROUPED: tl.constexpr, HAS_SCALE: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr, BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
):
    """a[p, n] = silu(x_t . gate_e[n]) * (x_t . up_e[n]) for the block's pairs, N tile ``pid 1``
    (each sum times ``scale[t]`` first, with ``HAS_SCALE``)."""
    wait_for_producer(PDL)  # the routing and the hidden states come from the previous kernels
    e, rows = _block_rows(ids_ptr, sorted_ptr, block_expert_ptr, GROUPED, BLOCK_M)
    if e >= 0:
        dtype = a_ptr.dtype.element_ty
        row_mask = rows < P
        tok = (rows // TOP_K).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        w_base = w_ptr + e.to(tl.int64) * stride_we
        gate_rows = w_base + offs_n.to(tl.int64)[:, None] * stride_wn
        up_rows = gate_rows + I * stride_wn
        if HAS_SCALE:  # issued before the K loop, so its round trip overlaps the loop instead of following it
            row_scale = tl.load(scale_ptr + tok, mask=row_mask, other=0.0)[:, None]
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < H
            x = tl.load(x_ptr + tok[:, None] * stride_x + offs_k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w_mask = n_mask[:, None] & k_mask[None, :]
            wg = tl.load(gate_rows + offs_k[None, :], mask=w_mask, other=0.0)
            wu = tl.load(up_rows + offs_k[None, :], mask=w_mask, other=0.0)
            if GROUPED:
                if DOT_F32:  # the interpreter's dot mishandles bf16 operands
                    x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
                if IEEE:  # fp32 models: full fp32 products, not TF32
                    acc_g += tl.dot(x, tl.trans(wg), input_precision="ieee")
                    acc_u += tl.dot(x, tl.trans(wu), input_precision="ieee")
                else:
                    acc_g += tl.dot(x, tl.trans(wg))
                    acc_u += tl.dot(x, tl.trans(wu))
            else:  # one row: multiply-reduce, no tensor-core tile of 15/16 padding
                xf = x.to(tl.float32)
                acc_g += tl.sum(wg.to(tl.float32) * xf, axis=1)[None, :]
                acc_u += tl.sum(wu.to(tl.float32) * xf, axis=1)[None, :]
        release_dependents(PDL)  # the down projection may launch while the tiles finish
        if HAS_SCALE:
            acc_g *= row_scale
            acc_u *= row_scale
        _store_activation(a_ptr, rows, row_mask, offs_n, n_mask, acc_g, acc_u, I, bias_ptr + e.to(tl.int64) * 2 * I,
                          alpha, limit, dtype, BF16, HAS_BIAS, SWIGLU)


@triton.jit
def _bias_row(b_ptr, offs_n, n_mask):
    """One expert's bias at columns ``offs_n`` as a [1, BLOCK_N] fp32 row."""
    return tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _store_activation(a_ptr, rows, row_mask, offs_n, n_mask, acc_g, acc_u, I, b_ptr, alpha, limit, dtype: tl.constexpr,
                      BF16: tl.constexpr, HAS_BIAS: tl.constexpr = False, SWIGLU: tl.constexpr = False):
    """a[rows, offs_n] = silu(gate) * up from the fp32 sums, rounded where the reference rounds
    (the gate/up epilogue of the dense and the quantized expert kernels). HAS_BIAS: the expert's
    bias (``b_ptr``: gate's, then up's at ``I``) added to each rounded sum; SWIGLU: gpt-oss's
    clamped SwiGLU, ``(clamp(up) + 1) * g * sigmoid(g * alpha)`` with ``g = min(gate, limit)``."""
    g = round_to(acc_g, dtype, BF16)
    u = round_to(acc_u, dtype, BF16)
    if HAS_BIAS:
        g = round_to(g + _bias_row(b_ptr, offs_n, n_mask), dtype, BF16)
        u = round_to(u + _bias_row(b_ptr + I, offs_n, n_mask), dtype, BF16)
    if SWIGLU:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        sig = round_to(1.0 / (1.0 + tl.exp(-round_to(g * alpha, dtype, BF16))), dtype, BF16)
        a = round_to(round_to(u + 1.0, dtype, BF16) * round_to(g * sig, dtype, BF16), dtype, BF16)
    else:
        act = round_to(g / (1.0 + tl.exp(-g)), dtype, BF16)
        a = round_to(act * u, dtype, BF16)
    tl.store(a_ptr + rows.to(tl.int64)[:, None] * I + offs_n[None, :], a.to(dtype),
             mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _token_ids(ids_ptr, t, TOP_K: tl.constexpr, K_POW2: tl.constexpr):
    """Token t's k expert ids [K_POW2] (padding: the largest int32, so it ranks last)."""
    slots = tl.arange(0, K_POW2)
    return tl.load(ids_ptr + t * TOP_K + slots, mask=slots < TOP_K, other=2147483647).to(tl.int32)


@triton.jit
def _sum_token(y_ptr, ids, out_ptr, t, offs, mask, H, TOP_K: tl.constexpr, K_POW2: tl.constexpr, BF16: tl.constexpr):
    """out[t, offs] = the sum of token t's k rows of y there, in ascending expert id ``ids``
    (the reference's order), fp32, rounded once. Reads y through L2 (other programs wrote it)."""
    slots = tl.arange(0, K_POW2)
    before = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (slots[None, :] < slots[:, None]))
    rank = tl.sum(before.to(tl.int32), axis=1)
    acc = tl.zeros(offs.shape, dtype=tl.float32)
    for r in tl.static_range(TOP_K):
        j = tl.sum(tl.where(rank == r, slots, 0), axis=0)
        acc += tl.load(y_ptr + (t * TOP_K + j).to(tl.int64) * H + offs, mask=mask, other=0.0, cache_modifier=".cg")
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + t.to(tl.int64) * H + offs, round_to(acc, dtype, BF16).to(dtype), mask=mask)


@triton.jit
def _down_kernel(
    a_ptr, w_ptr, y_ptr, weights_ptr, ids_ptr, sorted_ptr, block_expert_ptr,
    P, H, I, stride_we, stride_wn, out_ptr, counter_ptr, bias_ptr,
    ROUND_PRODUCT: tl.constexpr, GROUPED: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr,
    BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SUM_HERE: tl.constexpr, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
    PDL: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """y[p, n] = w_p * (a_p . down_e[n]) in fp32 for the block's pairs, N tile ``pid 1``.
    ``SUM_HERE`` (per pair): the last of a token's k programs on this tile also sums them into out."""
    wait_for_producer(PDL)  # the routing and the activations come from the previous kernels
    e, rows = _block_rows(ids_ptr, sorted_ptr, block_expert_ptr, GROUPED, BLOCK_M)
    if e >= 0:
        dtype = a_ptr.dtype.element_ty
        row_mask = rows < P
        a_rows = a_ptr + rows.to(tl.int64)[:, None] * I
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        w_rows = w_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        # the epilogue's operands, issued before the K loop so their round trips overlap it
        weight = tl.load(weights_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        if SUM_HERE:  # one pair a program: p = program 0; its token's expert ids, for the sum
            t = tl.program_id(0) // TOP_K
            ids = _token_ids(ids_ptr, t, TOP_K, K_POW2)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < I
            a = tl.load(a_rows + offs_k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            if GROUPED:
                if DOT_F32:
                    a, w = a.to(tl.float32), w.to(tl.float32)
                if IEEE:
                    acc += tl.dot(a, tl.trans(w), input_precision="ieee")
                else:
                    acc += tl.dot(a, tl.trans(w))
            else:
                acc += tl.sum(w.to(tl.float32) * a.to(tl.float32), axis=1)[None, :]
        release_dependents(PDL)  # the next kernel may launch while the token sums run
        _store_pairs(acc, weight, y_ptr, rows, row_mask, offs_n, n_mask, H, dtype, BF16, ROUND_PRODUCT,
                     bias_ptr + e.to(tl.int64) * H, HAS_BIAS)
        if SUM_HERE:
            _sum_when_last(counter_ptr, t, ids, y_ptr, out_ptr, offs_n, n_mask, H, TOP_K, K_POW2, BF16)


@triton.jit
def _store_pairs(acc, weight, y_ptr, rows, row_mask, offs_n, n_mask, H, dtype: tl.constexpr, BF16: tl.constexpr,
                 ROUND_PRODUCT: tl.constexpr, b_ptr=None, HAS_BIAS: tl.constexpr = False):
    """y[rows, offs_n] = w_p * the pairs' fp32 sums, rounded where the reference rounds (the down
    epilogue of the dense and the quantized expert kernels); HAS_BIAS: the expert's bias
    (``b_ptr``) added to the rounded sums first."""
    y = round_to(acc, dtype, BF16)
    if HAS_BIAS:
        y = round_to(y + _bias_row(b_ptr, offs_n, n_mask), dtype, BF16)
    y = y * weight[:, None]
    if ROUND_PRODUCT:
        y = round_to(y, dtype, BF16)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * H + offs_n[None, :], y, mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_when_last(counter_ptr, t, ids, y_ptr, out_ptr, offs_n, n_mask, H, TOP_K: tl.constexpr,
                   K_POW2: tl.constexpr, BF16: tl.constexpr):
    """Per pair: the last of token t's k programs on this N tile sums their rows into out and
    resets the tile's counter (left zero for the next launch)."""
    counter = counter_ptr + t * tl.num_programs(1) + tl.program_id(1)
    tl.debug_barrier()  # every thread's part of y is written before the release below
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == TOP_K - 1:
        _sum_token(y_ptr, ids, out_ptr, t, offs_n, n_mask, H, TOP_K, K_POW2, BF16)
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _sum_kernel(
    y_ptr, ids_ptr, out_ptr, H, TOP_K: tl.constexpr, K_POW2: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr,
):
    """out[t] = sum of token t's k rows of y, in ascending expert id (the reference's order), fp32."""
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    t = tl.program_id(0)
    _sum_token(y_ptr, _token_ids(ids_ptr, t, TOP_K, K_POW2), out_ptr, t, offs, offs < H, H, TOP_K, K_POW2, BF16)


_SUM_BLOCK = 256
_ALIGN_CHUNK = 1024


@cuda_kernel
def fused_moe(
    hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    row_scale: Optional[torch.Tensor] = None, gate_up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None, swiglu_alpha: float = 0.0, swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """Triton implementation of ``torch.ops.ingot.fused_moe``: ``run`` with ``launch_config``'s launch."""
    return run(hidden, w_gate_up, w_down, topk_weights, topk_ids, row_scale,
               epilogue=Epilogue(gate_up_bias, down_bias, swiglu_alpha, swiglu_limit))


def epilogue_args(ep: Epilogue, stand_in: torch.Tensor) -> tuple[tuple, tuple, dict, dict]:
    """(gate/up kernel arguments, down kernel arguments, and their constexprs) of an epilogue;
    ``stand_in`` takes the place of absent biases. Both biases or none."""
    assert (ep.gate_up_bias is None) == (ep.down_bias is None), "the experts' biases come in pairs"
    has_bias = ep.gate_up_bias is not None
    gb = ep.gate_up_bias.contiguous() if has_bias else stand_in
    db = ep.down_bias.contiguous() if has_bias else stand_in
    return ((gb, float(ep.alpha), float(ep.limit)), (db,), dict(HAS_BIAS=has_bias, SWIGLU=ep.alpha > 0),
            dict(HAS_BIAS=has_bias))


def run(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    row_scale: Optional[torch.Tensor] = None,
    launch: Optional[MoeLaunch] = None,
    epilogue: Epilogue = PLAIN,
) -> torch.Tensor:
    """The launches of one call; ``launch`` overrides the table (tests, sweeps)."""
    t, h = hidden.shape
    experts, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    out = torch.empty(t, h, dtype=hidden.dtype, device=hidden.device)
    if t == 0:
        return out
    assert w_gate_up.stride(-1) == 1 and w_down.stride(-1) == 1, "expert weights need a contiguous last dim"
    launch = launch or launch_config(experts, inter, t, hidden.device)
    pairs = t * top_k
    x = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    ids = topk_ids.contiguous().view(-1)
    weights = topk_weights.contiguous().view(-1)
    a = torch.empty(pairs, inter, dtype=hidden.dtype, device=hidden.device)
    y = torch.empty(pairs, h, dtype=torch.float32, device=hidden.device)
    if launch.grouped:
        bm = launch.block_m
        m_blocks = cdiv(pairs + min(experts, pairs) * (bm - 1), bm)
        sorted_ids = torch.empty(m_blocks * bm, dtype=torch.int32, device=hidden.device)
        block_expert = torch.empty(m_blocks, dtype=torch.int32, device=hidden.device)
        _align_kernel[(experts,)](
            ids, sorted_ids, block_expert, pairs, m_blocks,
            BLOCK_M=bm, CHUNK=min(_ALIGN_CHUNK, next_pow2(pairs)), E_BINS=next_pow2(experts),
            BLOCK_B=next_pow2(cdiv(pairs, bm)), num_warps=4,
        )
    else:
        m_blocks, sorted_ids, block_expert = pairs, ids, ids  # unused by the per-pair kernels
    dot_f32, bf16 = interpreting(), hidden.dtype == torch.bfloat16
    ieee = hidden.dtype == torch.float32 and not dot_f32
    pdl = launch.pdl and pdl_supported(hidden.device)
    bn, bk, warps, stages = launch.gate_up
    gu_args, down_args, gu_consts, down_consts = epilogue_args(epilogue, a)
    _gate_up_kernel[(m_blocks, cdiv(inter, bn))](
        x, w_gate_up, a, ids, sorted_ids, block_expert, row_scale.contiguous() if row_scale is not None else ids,
        *gu_args, pairs, h, inter, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
        TOP_K=top_k, GROUPED=launch.grouped, HAS_SCALE=row_scale is not None, DOT_F32=dot_f32, IEEE=ieee, BF16=bf16,
        BLOCK_M=launch.block_m, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl, **gu_consts,
        num_warps=warps, num_stages=stages, launch_pdl=pdl,
    )
    bn, bk, warps, stages = launch.down
    k_pow2 = max(2, next_pow2(top_k))
    # per pair, the down kernel sums each token's pairs itself (one counter per token and tile)
    counters = None if launch.grouped else split_counters(hidden.device, t * cdiv(h, bn))
    _down_kernel[(m_blocks, cdiv(h, bn))](
        a, w_down, y, weights, ids, sorted_ids, block_expert,
        pairs, h, inter, w_down.stride(0), w_down.stride(1), out, counters if counters is not None else ids, *down_args,
        ROUND_PRODUCT=topk_weights.dtype == hidden.dtype, GROUPED=launch.grouped, DOT_F32=dot_f32, IEEE=ieee, BF16=bf16,
        BLOCK_M=launch.block_m, BLOCK_N=bn, BLOCK_K=bk, SUM_HERE=counters is not None, TOP_K=top_k, K_POW2=k_pow2,
        PDL=pdl, **down_consts,
        num_warps=warps, num_stages=stages, launch_pdl=pdl,
    )
    if counters is None:
        _sum_kernel[(t, cdiv(h, _SUM_BLOCK))](
            y, ids, out, h, TOP_K=top_k, K_POW2=k_pow2, BF16=bf16, BLOCK=_SUM_BLOCK, num_warps=2,
        )
    return out


__all__ = ["fused_moe", "run", "launch_config", "MoeLaunch", "PER_PAIR", "PER_PAIR_NARROW", "PER_PAIR_LONG_K"]
