"""The ``torch.ops.ingot.*`` custom ops: schema, default (reference) impl, fake impl.

A model never calls a kernel directly; it calls these ops. To Dynamo/Inductor
each one is a single opaque node with a fake (meta) implementation, so compile
neither breaks the graph nor traces into a Triton launcher, and an outer CUDA
graph records the launch. The default implementation is the PyTorch reference;
CUDA kernels register themselves per op with ``op.register_kernel("cuda")``
(see ``ingot.ops.triton``). Ops that write the KV cache declare it in
``mutates_args``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.library import custom_op

from ingot.ops import reference as ref


@custom_op("ingot::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return ref.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@custom_op("ingot::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return ref.add_rms_norm(x, residual, weight, eps)


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@custom_op("ingot::rotary_embedding", mutates_args=())
def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return ref.rotary_embedding(positions, q, k, cos_sin_cache)


@rotary_embedding.register_fake
def _(positions, q, k, cos_sin_cache):
    return torch.empty_like(q), torch.empty_like(k)


@custom_op("ingot::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return ref.silu_and_mul(x)


@silu_and_mul.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@custom_op("ingot::store_kv", mutates_args=("k_cache", "v_cache"))
def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    ref.store_kv(k, v, k_cache, v_cache, slot_mapping)


@store_kv.register_fake
def _(k, v, k_cache, v_cache, slot_mapping):
    return None


@custom_op("ingot::decode_attention", mutates_args=())
def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return ref.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)


@decode_attention.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, scale):
    return torch.empty_like(q)


@custom_op("ingot::decode_attention_rope", mutates_args=("k_cache", "v_cache"))
def decode_attention_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 0.0,
) -> torch.Tensor:
    """(rms_norm of q and k per head, when given +) rotary_embedding + store_kv +
    decode_attention as one op (one launch on CUDA)."""
    return ref.decode_attention_rope(
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale,
        q_norm_weight, k_norm_weight, norm_eps,
    )


@decode_attention_rope.register_fake
def _(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale,
      q_norm_weight=None, k_norm_weight=None, norm_eps=0.0):
    return torch.empty_like(q)


@custom_op("ingot::prefill_attention", mutates_args=())
def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return ref.prefill_attention(
        q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale
    )


@prefill_attention.register_fake
def _(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
    return torch.empty_like(q)


@custom_op("ingot::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return ref.skinny_linear(x, weight, bias)


@skinny_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


@custom_op("ingot::rms_norm_linear", mutates_args=())
def rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    return ref.rms_norm_linear(x, residual, norm_weight, eps, weight, bias)


@rms_norm_linear.register_fake
def _(x, residual, norm_weight, eps, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0]), torch.empty_like(x)


@custom_op("ingot::rms_norm_linear_scaled", mutates_args=())
def rms_norm_linear_scaled(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return ref.rms_norm_linear_scaled(x, residual, norm_weight, eps, weight, bias)


@rms_norm_linear_scaled.register_fake
def _(x, residual, norm_weight, eps, weight, bias):
    rstd = x.new_empty(x.shape[0], dtype=torch.float32)
    return x.new_empty(x.shape[0], weight.shape[0]), torch.empty_like(x), torch.empty_like(x), rstd


@custom_op("ingot::linear_norm_linear_scaled", mutates_args=())
def linear_norm_linear_scaled(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
    norm_weight: torch.Tensor, eps: float, router_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return ref.linear_norm_linear_scaled(x, weight, bias, residual, norm_weight, eps, router_weight)


@linear_norm_linear_scaled.register_fake
def _(x, weight, bias, residual, norm_weight, eps, router_weight):
    rows = x.shape[0]
    rstd = x.new_empty(rows, dtype=torch.float32)
    return x.new_empty(rows, router_weight.shape[0]), torch.empty_like(residual), torch.empty_like(residual), rstd


@custom_op("ingot::silu_mul_linear", mutates_args=())
def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return ref.silu_mul_linear(x, weight, bias)


@silu_mul_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


@custom_op("ingot::fused_moe", mutates_args=())
def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    row_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The experts of a MoE layer for routed tokens (routing itself stays PyTorch in the model)."""
    return ref.fused_moe(hidden, w_gate_up, w_down, topk_weights, topk_ids, row_scale)


@fused_moe.register_fake
def _(hidden, w_gate_up, w_down, topk_weights, topk_ids, row_scale=None):
    return torch.empty_like(hidden)
