"""Every ingot op, declared once: its PyTorch reference, schema and fake.

``@op(fake=...)`` on a reference function declares ``torch.ops.ingot.<its name>``
(library.py creates the ops): the function's annotations are the op's schema, its
body the default implementation, ``fake`` the shapes of its outputs for tracing
(the kernels' layouts: mostly ``empty_like`` of an input), ``mutates_args`` what it
writes in place. The decorator returns the function unchanged, so references that
call each other stay plain PyTorch (on CUDA the op would run a Triton kernel inside
the ground truth). CUDA kernels register themselves in ``ingot.ops.triton``.

The references are the CPU implementation, the CUDA fallback until a kernel
exists, the form Inductor traces when an op runs "native" under compile, and the
ground truth in tests. Numerics follow HF transformers: RMSNorm and rotary tables
in fp32, attention softmax in fp32, results cast back to the input dtype.

Shapes: tokens are flattened (T = total tokens of the step). KV caches are
``[num_blocks, block_size, num_kv_heads, head_dim]``; slot = block * block_size
+ offset; block 0 is reserved as the padding dummy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import torch

from ingot.ops.reference_quant import Epilogue, experts_loop

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class OpDecl:
    """One op: ``reference`` (name, schema, default implementation), ``fake`` and ``mutates_args``."""

    reference: Callable[..., Any]
    fake: Callable[..., Any]
    mutates_args: tuple[str, ...] = ()


DECLARED: dict[str, OpDecl] = {}


def op(fake: Callable[..., Any], mutates_args: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Declare the decorated reference as ``torch.ops.ingot.<its name>``; returns it unchanged.

    ``fake`` receives the op's arguments positionally (trailing defaults may be left off),
    so it names those it needs and takes the rest as ``*_``.
    """

    def declare(fn: F) -> F:
        DECLARED[fn.__name__] = OpDecl(fn, fake, tuple(mutates_args))
        return fn

    return declare


def _like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t)


def _projected(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The fake of ``x @ weight.T``."""
    return x.new_empty(x.shape[0], weight.shape[0])


def _row_scale(x: torch.Tensor) -> torch.Tensor:
    """The fake of one fp32 rstd per row of ``x``."""
    return x.new_empty(x.shape[0], dtype=torch.float32)


@op(fake=lambda x, *_: _like(x))
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


@op(fake=lambda x, *_: (_like(x), _like(x)))
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the add in the model dtype, as HF does."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@op(fake=lambda positions, q, k, *_: (_like(q), _like(k)))
def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary on q [T, Hq, D] and k [T, Hkv, D].

    ``cos_sin_cache`` is fp32 ``[max_pos, D]``: cos in the first D/2 columns, sin
    in the last D/2. Like HF, the table is cast to the activation dtype first.
    """
    cs = cos_sin_cache.index_select(0, positions)
    half = cs.shape[-1] // 2
    cos = torch.cat((cs[:, :half], cs[:, :half]), dim=-1).to(q.dtype).unsqueeze(1)
    sin = torch.cat((cs[:, half:], cs[:, half:]), dim=-1).to(q.dtype).unsqueeze(1)
    q_out = q * cos + _rotate_half(q) * sin
    k_out = k * cos + _rotate_half(k) * sin
    return q_out, k_out


@op(fake=lambda x: x.new_empty(*x.shape[:-1], x.shape[-1] // 2))
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:] for the merged gate/up projection."""
    half = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :half]) * x[..., half:]


@op(fake=lambda *_: None, mutates_args=("k_cache", "v_cache"))
def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, Hkv, D] into the caches at ``slot_mapping`` [T]."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, M] block ids -> [B, M * block_size, Hkv, D] context of each row."""
    b, m = block_tables.shape
    g = cache.index_select(0, block_tables.reshape(-1).long())
    return g.view(b, m * cache.shape[1], cache.shape[2], cache.shape[3])


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D], mask [B, Tq, Tk] -> [B, Tq, Hq, D] (fp32 math).
    ``softcap`` > 0: logits become ``softcap * tanh(logits / softcap)`` before the mask (Gemma 2).
    ``sinks`` [Hq]: one more logit per head that joins the softmax's denominator only (gpt-oss;
    HF appends it as a column and drops that column's probability)."""
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    qf = q.float().view(b, tq, hkv, g, d)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qf, k.float()) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask[:, None, None, :, :], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().view(1, hkv, g, 1, 1).expand(b, hkv, g, tq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.float())
    return out.reshape(b, tq, hq, d).to(q.dtype)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Causal visibility of keys at ``k_pos`` to queries at ``q_pos`` (broadcast): ``k <= q``, and
    with ``window`` > 0 also ``q - k < window`` (HF's sliding window: a query sees itself and
    the ``window - 1`` tokens before it)."""
    mask = k_pos <= q_pos
    return mask & (q_pos - k_pos < window) if window > 0 else mask


@op(fake=lambda q, *_: _like(q))
def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, window: int = 0, softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One query per row: q [B, Hq, D] over the first ``seq_lens[b]`` cached tokens, the last
    ``window`` of them when ``window`` > 0; logits soft-capped when ``softcap`` > 0; ``sinks``
    [Hq] (fp32 or the model dtype): a per-head logit in the softmax's denominator only.

    Static shapes only (no host sync), so it can be captured in a CUDA graph.
    """
    k = _gather_context(k_cache, block_tables)
    v = _gather_context(v_cache, block_tables)
    pos = torch.arange(k.shape[1], device=q.device)
    mask = visible(seq_lens[:, None].to(pos.dtype) - 1, pos[None, :], window).unsqueeze(1)
    return _attend(q.unsqueeze(1), k, v, mask, scale, softcap, sinks).squeeze(1)


@op(fake=lambda q, *_: _like(q), mutates_args=("k_cache", "v_cache"))
def decode_attention_rope(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None, norm_eps: float = 0.0, window: int = 0, softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """A decode step's attention from its unrotated q, k, v: (per-head RMSNorm of q and k,
    as Qwen3 has,) rotary, KV store, attention (``window``, ``softcap``, ``sinks``: decode_attention's).

    Exactly the reference ops in sequence (the fused kernel's ground truth).
    """
    if q_norm_weight is not None:
        q = rms_norm(q, q_norm_weight, norm_eps)
    if k_norm_weight is not None:
        k = rms_norm(k, k_norm_weight, norm_eps)
    q, k = rotary_embedding(positions, q, k, cos_sin_cache)
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, sinks)


@op(fake=lambda q, *_: _like(q))
def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
    window: int = 0, softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention for packed new tokens q [T, Hq, D] (``window``, ``softcap``, ``sinks``: decode_attention's).

    Row b owns queries ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, the last of its
    ``seq_lens[b]`` tokens; earlier context (chunked prefill) is read from the
    cache, which already holds the new k, v (stored before attention). ``k`` and
    ``v`` are accepted for kernels that read new tokens directly.
    """
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        s, e, total = starts[b], starts[b + 1], lens[b]
        nq = e - s
        n_blocks = -(-total // k_cache.shape[1])
        table = block_tables[b : b + 1, :n_blocks]
        kc = _gather_context(k_cache, table)[:, :total]
        vc = _gather_context(v_cache, table)[:, :total]
        qpos = torch.arange(total - nq, total, device=q.device)
        kpos = torch.arange(total, device=q.device)
        mask = visible(qpos[:, None], kpos[None, :], window).unsqueeze(0)
        out[s:e] = _attend(q[s:e].unsqueeze(0), kc, vc, mask, scale, softcap, sinks).squeeze(0)
    return out


@op(fake=lambda x, weight, bias=None, out_dtype=None: x.new_empty(x.shape[0], weight.shape[0], dtype=out_dtype or x.dtype))
def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """y = x @ weight.T (+ bias): the GEMM of a few rows (kernel: ops/triton/skinny_gemm.py),
    in ``out_dtype`` (default x's): fp32 sums kept unrounded (the logits, ``layers.linear.logits_linear``)."""
    if out_dtype is None or out_dtype == x.dtype:
        return torch.nn.functional.linear(x, weight, bias)
    return torch.nn.functional.linear(x.to(out_dtype), weight.to(out_dtype), None if bias is None else bias.to(out_dtype))


@op(fake=lambda x, residual, norm_weight, eps, weight, *_: (_projected(x, weight), _like(x)))
def rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(add_rms_norm(x, residual) projected by weight, x + residual): the norm fused in front of a GEMM."""
    h, new_residual = add_rms_norm(x, residual, norm_weight, eps)
    return skinny_linear(h, weight, bias), new_residual


@op(fake=lambda x, residual, norm_weight, eps, weight, *_: (_projected(x, weight), _like(x), _like(x), _row_scale(x)))
def rms_norm_linear_scaled(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rms_norm_linear``, and its normed input in two factors for a second consumer:
    ``norm_weight * (x + residual)`` (model dtype) and each row's rstd (fp32, [T]); their
    product is the normed row up to rounding (``fused_moe``'s ``row_scale`` takes the rstd)."""
    out, new_residual = rms_norm_linear(x, residual, norm_weight, eps, weight, bias)
    rstd = torch.rsqrt(new_residual.float().pow(2).mean(-1) + eps)
    return out, new_residual, norm_weight * new_residual, rstd


@op(fake=lambda x, weight, bias, residual, norm_weight, eps, router_weight: (
    _projected(x, router_weight), _like(residual), _like(residual), _row_scale(x)))
def linear_norm_linear_scaled(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
    norm_weight: torch.Tensor, eps: float, router_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rms_norm_linear_scaled`` of ``x`` projected by ``weight``: a projection whose output
    joins the residual stream (attention's o_proj), then a MoE layer's norm and router, in one
    op, so the router's GEMV needs no launch of its own (kernel: ops/triton/skinny_gemm.py)."""
    return rms_norm_linear_scaled(skinny_linear(x, weight, bias), residual, norm_weight, eps, router_weight, None)


@op(fake=lambda x, weight, *_: _projected(x, weight))
def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """silu_and_mul(x) projected by weight: the activation fused in front of the down projection."""
    return skinny_linear(silu_and_mul(x), weight, bias)


@op(fake=lambda hidden, *_: _like(hidden))
def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    row_scale: Optional[torch.Tensor] = None,
    gate_up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
    swiglu_alpha: float = 0.0,
    swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """Mixture-of-experts MLP: each token through its ``k`` chosen experts, weighted and summed.

    hidden [T, H]; w_gate_up [E, 2I, H] (gate rows first, then up); w_down [E, H, I];
    topk_weights [T, k] (model dtype, or fp32 as Mixtral keeps them); topk_ids [T, k];
    row_scale [T] (fp32), optional: multiplies each token's gate/up sums before they are
    rounded, so ``hidden`` can be a normed row's two factors (``rms_norm_linear_scaled``).
    gate_up_bias [E, 2I] / down_bias [E, H], optional: added to each projection's output
    (gpt-oss). ``swiglu_alpha`` > 0 selects gpt-oss's clamped SwiGLU for ``silu(gate) * up``
    (``reference_quant.activation``).

    HF transformers' eager experts loop, step for step: experts in ascending id,
    each computing ``down(silu(gate) * up)`` of its tokens in the model dtype and
    multiplying by the routing weight (dtype promotion as in HF: a bf16 product
    for bf16 weights, fp32 for fp32 weights). The sum over a token's experts runs
    in that same expert order but accumulates in fp32 (HF accumulates in the
    model dtype), rounded once at the end; in fp32 it is HF's result bit for bit.

    Finding the experts hit costs a host sync, which a CUDA graph cannot hold: while
    a capture is under way (decode graphs with the Triton kernels off) every expert
    runs on every token instead, the unrouted ones weighted by zero (same sums).
    """
    return experts_loop(hidden, w_gate_up.shape[0], w_gate_up.__getitem__, w_down.__getitem__, topk_weights, topk_ids,
                        row_scale, None, Epilogue(gate_up_bias, down_bias, swiglu_alpha, swiglu_limit))


def _experts_loop(
    hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, every_expert: bool, row_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``fused_moe`` with the capture's every-expert form forced on or off (tests)."""
    return experts_loop(hidden, w_gate_up.shape[0], w_gate_up.__getitem__, w_down.__getitem__, topk_weights, topk_ids,
                        row_scale, every=every_expert)


# ---------------------------------------------------------------------- quantized linear layers
# The canonical forms (ingot/loading/quant_scheme.py): int4 / int8 weights packed along K with
# group scales (optional zero points and mins), and float8 e4m3 weights with block scales.
FP8_MAX = 448.0  # the largest float8 e4m3fn value


def unpack_int(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [N, K * bits / 32] -> the unsigned values [N, K] (int32), little-endian along K."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=qweight.device, dtype=torch.int32) * bits
    values = (qweight.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(qweight.shape[0], qweight.shape[1] * pack)


def pack_int(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of ``unpack_int``: unsigned values [N, K] (K a multiple of 32 / bits) -> int32 words."""
    pack = 32 // bits
    n, k = values.shape
    shifts = torch.arange(pack, device=values.device, dtype=torch.int64) * bits
    words = (values.to(torch.int64).reshape(n, k // pack, pack) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _per_group(t: torch.Tensor, group_size: int, k: int) -> torch.Tensor:
    """[N, K / group_size] -> [N, K] in fp32, each group's value repeated over its columns."""
    return t.float().repeat_interleave(group_size, dim=1)[:, :k]


def dequantize_int(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], mins: Optional[torch.Tensor],
    bits: int, group_size: int, zero_point: int, dtype: torch.dtype,
) -> torch.Tensor:
    """The [N, K] weight of the int form: (u - zero) * scale (+ min) in fp32, rounded once to ``dtype``."""
    u = unpack_int(qweight, bits).float()
    k = u.shape[1]
    zero = _per_group(zeros, group_size, k) if zeros is not None else float(zero_point)
    w = (u - zero) * _per_group(scales, group_size, k)
    if mins is not None:
        w = w + _per_group(mins, group_size, k)
    return w.to(dtype)


def _int_linear_fake(x, qweight, *_):
    return x.new_empty(x.shape[0], qweight.shape[0])


@op(fake=_int_linear_fake)
def int_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
    mins: Optional[torch.Tensor], bias: Optional[torch.Tensor], bits: int, group_size: int, zero_point: int,
) -> torch.Tensor:
    """y = x @ W.T (+ bias) for int4 / int8 weights in the canonical int form (kernel:
    ops/triton/int_linear.py dequantizes in registers, never a full-precision copy of W)."""
    w = dequantize_int(qweight, scales, zeros, mins, bits, group_size, zero_point, x.dtype)
    return torch.nn.functional.linear(x, w, bias)


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor, block_n: int, block_k: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight of the fp8 form: each element times its block's scale, in fp32, rounded once."""
    n, k = weight.shape
    bn, bk = block_n or n, block_k or k
    scale = weight_scale.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (weight.float() * scale).to(dtype)


def quantize_fp8_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in float8 e4m3, fp32 scales [T, K / group]): each row (``group`` 0) or each group of
    ``group`` columns of a row scaled so that its largest magnitude is the fp8 maximum."""
    t, k = x.shape
    g = group or k
    blocks = x.float().reshape(t, -1, g)
    # times the fp32 reciprocal, not a division: what PyTorch's CUDA division by a scalar does too,
    # so the scales are the same bits on every device and in the kernel
    scale = (blocks.abs().amax(-1) * (1.0 / FP8_MAX)).clamp(min=1e-12)
    q = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(t, k), scale


@op(fake=_int_linear_fake)
def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor],
    block_n: int, block_k: int, act_group: int,
) -> torch.Tensor:
    """y = x @ W.T (+ bias) for float8 e4m3 weights with block scales; with ``act_group`` >= 0
    the activations are quantized to fp8 first (per token, or per token and ``act_group``
    columns), as W8A8 checkpoints are run. fp32 accumulation, rounded once to x's dtype."""
    w = dequantize_fp8(weight, weight_scale, block_n, block_k, torch.float32)
    if act_group >= 0:
        q, scale = quantize_fp8_activations(x, act_group)
        xf = (q.float().reshape(x.shape[0], scale.shape[1], -1) * scale.unsqueeze(-1)).reshape(x.shape)
    else:
        xf = x.float()
    y = xf @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ---------------------------------------------------------------------- quantized routed experts
# ``fused_moe`` with every expert's weights in one canonical form, stacked [E, ...] as FusedMoE
# holds them (gate rows then up rows); the loop is reference_quant.py's (dequantizing the touched
# experts only), the kernels ops/triton/fused_moe_quant.py.


@op(fake=lambda hidden, *_: _like(hidden))
def fused_moe_int(
    hidden: torch.Tensor, gate_up_qweight: torch.Tensor, gate_up_scales: torch.Tensor,
    gate_up_zeros: Optional[torch.Tensor], gate_up_mins: Optional[torch.Tensor], down_qweight: torch.Tensor,
    down_scales: torch.Tensor, down_zeros: Optional[torch.Tensor], down_mins: Optional[torch.Tensor],
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, bits: int, group_size: int, zero_point: int,
    row_scale: Optional[torch.Tensor] = None, gate_up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None, swiglu_alpha: float = 0.0, swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """``fused_moe`` with int4 / int8 experts: qweight [E, N, K * bits / 32], scales (zeros,
    mins) [E, N, K / group_size] of gate_up (N = 2I, K = H) and down (N = H, K = I);
    ``group_size`` 0: one group per row of each projection; biases and ``swiglu_*``: fused_moe's."""

    def expert(q: torch.Tensor, s: torch.Tensor, z: Optional[torch.Tensor], m: Optional[torch.Tensor]):
        k = q.shape[-1] * 32 // bits
        return lambda e: dequantize_int(q[e], s[e], None if z is None else z[e], None if m is None else m[e], bits,
                                        group_size or k, zero_point, hidden.dtype)

    return experts_loop(hidden, gate_up_qweight.shape[0], expert(gate_up_qweight, gate_up_scales, gate_up_zeros, gate_up_mins),
                        expert(down_qweight, down_scales, down_zeros, down_mins), topk_weights, topk_ids, row_scale,
                        epilogue=Epilogue(gate_up_bias, down_bias, swiglu_alpha, swiglu_limit))


@op(fake=lambda hidden, *_: _like(hidden))
def fused_moe_fp8(
    hidden: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
    down_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, block_n: int, block_k: int,
    act_group: int, row_scale: Optional[torch.Tensor] = None, gate_up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None, swiglu_alpha: float = 0.0, swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """``fused_moe`` with float8 e4m3 experts: gate_up [E, 2I, H], down [E, H, I], each with
    fp32 block scales (``fp8_linear``'s blocks; 0: the whole dimension of each projection,
    so gate_up_scale holds gate's block rows, then up's); ``act_group`` as fp8_linear's;
    biases and ``swiglu_*``: fused_moe's (MXFP4 experts arrive in this form: block_k 32)."""

    def expert(w: torch.Tensor, s: torch.Tensor, parts: int):
        return lambda e: torch.cat([dequantize_fp8(wp, sp, block_n, block_k, hidden.dtype)
                                    for wp, sp in zip(w[e].chunk(parts), s[e].chunk(parts))])

    act = None if act_group < 0 else lambda x: _fp8_rounded(x, act_group)
    return experts_loop(hidden, gate_up.shape[0], expert(gate_up, gate_up_scale, 2), expert(down, down_scale, 1),
                        topk_weights, topk_ids, row_scale, act, Epilogue(gate_up_bias, down_bias, swiglu_alpha, swiglu_limit))


def _fp8_rounded(x: torch.Tensor, group: int) -> torch.Tensor:
    """x rounded through fp8 as W8A8 quantizes it (``quantize_fp8_activations``), in fp32."""
    q, scale = quantize_fp8_activations(x, group)
    return (q.float().reshape(x.shape[0], scale.shape[1], -1) * scale.unsqueeze(-1)).reshape(x.shape)
