"""norm_qkv_decode_attention_rope: a decode step's qkv GEMV and its attention, the merge moved across.

At one token the qkv GEMV (``skinny_gemm``, norm prologue) streams its weight in K splits, and
the last of each tile's programs adds the splits' fp32 sums: an atomic round trip and a load
round trip at the end of the launch, which the attention kernel after it waits through. Here
the GEMV's programs store their sums and end (``rms_norm_linear_partials``), and the fused decode
attention kernel (``decode_attention``, ``QkvParts``) adds up the columns of q, k and v it reads,
in split order as the merging program would, times the row's rstd, plus the bias: the same
values, bit for bit, and one merge fewer at the launch boundary. More rows than one run the two
ops as they are.
"""

from __future__ import annotations

from typing import Optional

import torch

from ingot.ops.triton import decode_attention, skinny_gemm


def norm_qkv_decode_attention_rope(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
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
    num_splits: Optional[int] = None,
    config: Optional[decode_attention.DecodeConfig] = None,
    gemm_config: Optional[skinny_gemm.SkinnyConfig] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of ``torch.ops.ingot.norm_qkv_decode_attention_rope``: for one row,
    the qkv GEMV (norm prologue) leaves its split-K sums unmerged and this kernel merges the
    columns each program reads; more rows run ``rms_norm_linear`` and ``decode_attention_rope``."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    q_size = weight.shape[0] - 2 * num_kv_heads * head_dim
    if x.shape[0] != 1:
        qkv, new_residual = skinny_gemm.rms_norm_linear(x, residual, norm_weight, eps, weight, bias, gemm_config)
        q, k, v = qkv.split([q_size, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        t = x.shape[0]
        out = decode_attention.decode_attention_rope(
            q.view(t, -1, head_dim), k.view(t, num_kv_heads, head_dim), v.view(t, num_kv_heads, head_dim),
            positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale,
            q_norm_weight, k_norm_weight, norm_eps, num_splits, config,
        )
        return out, new_residual
    part, sumsq, new_residual = skinny_gemm.rms_norm_linear_partials(x, residual, norm_weight, eps, weight, gemm_config)
    row = part[:, 0, :]  # [S, N], split 0 first
    kv_size = num_kv_heads * head_dim
    q = row[0, :q_size].view(1, -1, head_dim)
    k = row[0, q_size:q_size + kv_size].view(1, num_kv_heads, head_dim)
    v = row[0, q_size + kv_size:].view(1, num_kv_heads, head_dim)
    parts = decode_attention.QkvParts(sumsq.view(-1), bias, row.shape[0], row.stride(0), x.shape[1], eps, x.dtype)
    out = decode_attention.decode_attention_rope(
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale,
        q_norm_weight, k_norm_weight, norm_eps, num_splits, config, qkv_parts=parts,
    )
    return out, new_residual


__all__ = ["norm_qkv_decode_attention_rope"]
