"""Multi-head latent attention (DeepSeek-V2 / V3) over the compressed paged cache: references.

Declared like the ops of reference.py (``@op``), in a file of their own. The cache
of a layer is ``[num_blocks, block_size, 1, R + P]``: per token the normed latent
``c`` (``R = kv_lora_rank`` values) and the rope'd key ``k_pe`` (``P =
qk_rope_head_dim``). Attention runs in the absorbed form, multi-query attention
over those entries: the caller has projected each head's no-rope query through
W_UK into the latent space (``q_latent`` [.., H, R]); the score of a cached token
is ``(q_latent . c + q_pe . k_pe) * scale``, and the output is the weighted sum
of the latents ``c`` (the value is the key's prefix), which the caller projects
through W_UV. Softmax and sums in fp32, results in the query's dtype.
"""

from __future__ import annotations

import torch

from ingot.ops.reference import _gather_context, _like, op


@op(fake=lambda *_: None, mutates_args=("kv_cache",))
def mla_store_kv(latent: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's normed latent [T, R] and rope'd key [T, P] into its cache slot."""
    nb, bs, _, d = kv_cache.shape
    r = latent.shape[-1]
    flat = kv_cache.view(nb * bs, d)
    flat[:, :r].index_copy_(0, slot_mapping, latent.to(kv_cache.dtype))
    flat[:, r:].index_copy_(0, slot_mapping, k_pe.reshape(k_pe.shape[0], -1).to(kv_cache.dtype))


def _mla_attend(q_latent: torch.Tensor, q_pe: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor,
                scale: float) -> torch.Tensor:
    """q_latent [B, Tq, H, R], q_pe [B, Tq, H, P], ctx [B, S, R + P], mask [B, Tq, S] -> [B, Tq, H, R]."""
    r = q_latent.shape[-1]
    c, k_pe = ctx[..., :r].float(), ctx[..., r:].float()
    scores = torch.einsum("bqhr,bsr->bhqs", q_latent.float(), c) + torch.einsum("bqhp,bsp->bhqs", q_pe.float(), k_pe)
    scores = (scores * scale).masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhqs,bsr->bqhr", probs, c).to(q_latent.dtype)


@op(fake=lambda q_latent, *_: _like(q_latent))
def mla_decode_attention(
    q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """One query per row: q_latent [B, H, R], q_pe [B, H, P] over the first ``seq_lens[b]`` cached
    entries of row b -> [B, H, R]. Static shapes (graph-safe)."""
    ctx = _gather_context(kv_cache, block_tables).squeeze(2)
    pos = torch.arange(ctx.shape[1], device=q_latent.device)
    mask = (pos[None, :] < seq_lens[:, None].to(pos.dtype)).unsqueeze(1)
    return _mla_attend(q_latent.unsqueeze(1), q_pe.unsqueeze(1), ctx, mask, scale).squeeze(1)


@op(fake=lambda q_latent, *_: _like(q_latent))
def mla_prefill_attention(
    q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Causal attention of packed new tokens q_latent [T, H, R], q_pe [T, H, P] -> [T, H, R]. Row b
    owns queries ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, the last of its ``seq_lens[b]`` tokens;
    the cache already holds every one of them (prefix, earlier chunks and this step's)."""
    out = torch.empty_like(q_latent)
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    bs = kv_cache.shape[1]
    for b, total in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        ctx = _gather_context(kv_cache, block_tables[b : b + 1, : -(-total // bs)])[:, :total].squeeze(2)
        qpos = torch.arange(total - (e - s), total, device=q_latent.device)
        mask = (torch.arange(total, device=q_latent.device)[None, :] <= qpos[:, None]).unsqueeze(0)
        out[s:e] = _mla_attend(q_latent[None, s:e], q_pe[None, s:e], ctx, mask, scale)[0]
    return out
