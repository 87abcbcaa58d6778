"""Paged attention: rotary, store this step's K/V into the cache, then attend over it.

Decode runs the three as one op (``decode_attention_rope``: one kernel launch
per layer on CUDA); prefill, decode under a compile policy that keeps rotary in
its PyTorch form (so Inductor can fuse it), and decode rows that read each
other's K/V (``store_first``: a verify step's rows) run them one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ingot.layers.norm import RMSNorm
from ingot.layers.rotary import RotaryEmbedding
from ingot.layers.policy import DEFAULT_POLICY, OpPolicy


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, all device tensors (graph-safe for decode).

    slot_mapping [T]: cache slot of each new token (padding rows: slot 0, the dummy).
    block_tables [B, M]: KV block ids of each sequence (unused entries 0).
    seq_lens [B]: tokens in each sequence's context, this step's included.
    cu_seqlens_q [B+1]: prefill only; offsets of each sequence's new tokens.
    store_first: decode rows may read K/V that other rows of the step write (speculative
    decoding's verify rows: one row per position of a sequence, each over the same block
    table), so every row's K/V is stored before any row attends. A Python constant of
    the forward (a graph is captured per value), never a tensor.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: Optional[torch.Tensor] = None
    store_first: bool = False


class Attention(nn.Module):
    """Holds a view of its layer's KV cache (set by the model runner). ``window`` > 0: a query
    sees only the last ``window`` tokens (itself included); ``softcap`` > 0: logits are
    soft-capped (Gemma 2)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int = 0,
                 softcap: float = 0.0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.window = window
        self.softcap = softcap
        self.k_cache: Optional[torch.Tensor] = None
        self.v_cache: Optional[torch.Tensor] = None

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        rotary: RotaryEmbedding,
        policy: OpPolicy = DEFAULT_POLICY,
        qk_norm: Optional[tuple[RMSNorm, RMSNorm]] = None,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], not yet rotated -> [T, Hq, D]. ``qk_norm``: the
        per-head RMSNorms of q and k (Qwen3), applied first; the fused decode op folds them in.
        ``sinks`` [Hq]: gpt-oss's per-head logits in the softmax's denominator (None: none).

        The fused decode op stores each row's K/V and attends in one launch (a row's own K/V
        from registers), so a row would read another row's K/V before that row's program
        wrote it: ``meta.store_first`` rows take the three ops one by one instead."""
        extra = {} if sinks is None else {"sinks": sinks}  # the ops' calls unchanged for every other model
        assert self.k_cache is not None, "KV cache not bound: ModelRunner allocates it"
        if not meta.is_prefill and not meta.store_first and not policy.is_native("rotary"):
            norms = {} if qk_norm is None else dict(q_norm_weight=qk_norm[0].weight, k_norm_weight=qk_norm[1].weight,
                                                    norm_eps=qk_norm[0].eps)
            return torch.ops.ingot.decode_attention_rope(
                q, k, v, positions, rotary.cos_sin_cache, self.k_cache, self.v_cache,
                meta.slot_mapping, meta.block_tables, meta.seq_lens, self.scale, **norms,
                window=self.window, softcap=self.softcap, **extra,
            )
        if qk_norm is not None:
            q, k = qk_norm[0](q, None, policy), qk_norm[1](k, None, policy)
        q, k = rotary(positions, q, k, policy)
        torch.ops.ingot.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if meta.is_prefill:
            return torch.ops.ingot.prefill_attention(
                q, k, v, self.k_cache, self.v_cache, meta.cu_seqlens_q,
                meta.seq_lens, meta.block_tables, self.scale, self.window, self.softcap, **extra,
            )
        return torch.ops.ingot.decode_attention(
            q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens, self.scale, self.window, self.softcap, **extra
        )
