"""Shared cases of the latent-attention ops: paged [latent | rope key] caches, queries, and
the dense, non-absorbed attention they must equal (keys and values decompressed per head)."""

from __future__ import annotations

import torch

from tests.ops.kernel_cases import paged


def mla_case(lens: list[int], heads: int, rank: int, rope: int, page: int, dtype: torch.dtype, gen: torch.Generator,
             rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_latent [B, H, R], q_pe [B, H, P], kv_cache [N, page, 1, R + P], block table) for ``lens``
    (``rows``: that many query rows per sequence, prefill's, else one)."""
    cache, _, table = paged(lens, page, 1, rank + rope, dtype, gen)
    n = len(lens) * (rows or 1)
    q_latent = torch.randn(n, heads, rank, generator=gen).to(dtype)
    q_pe = torch.randn(n, heads, rope, generator=gen).to(dtype)
    return q_latent, q_pe, cache, table


def dense_mla(q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, k_pe: torch.Tensor, w_uk: torch.Tensor,
              w_uv: torch.Tensor, scale: float, causal_offset: int | None = None) -> torch.Tensor:
    """Multi-head attention as DeepSeek's modeling code writes it, for one sequence: q_nope [Tq, H, N],
    q_pe [Tq, H, P], latents [S, R], k_pe [S, P], W_UK [H, N, R], W_UV [H, V, R] -> [Tq, H, V].
    ``causal_offset``: query i sits at position ``causal_offset + i`` (None: it sees every key)."""
    k_nope = torch.einsum("hnr,sr->shn", w_uk, latents)  # each head's keys and values, decompressed
    v = torch.einsum("hvr,sr->shv", w_uv, latents)
    heads = q_nope.shape[1]
    k = torch.cat((k_nope, k_pe[:, None, :].expand(-1, heads, -1)), dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1)
    scores = torch.einsum("qhd,shd->hqs", q, k) * scale
    if causal_offset is not None:
        qpos = causal_offset + torch.arange(q.shape[0])[:, None]
        scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqs,shv->qhv", scores.softmax(-1), v)
