"""The latent-attention references (ops/reference_mla.py) against dense multi-head attention
over keys and values decompressed from the latents: the absorbed form computes the same thing."""

from __future__ import annotations

import torch

from ingot.ops import reference_mla as ref
from tests.ops.mla_cases import dense_mla

H, N, P, R, V, PAGE = 3, 8, 4, 12, 6, 4


def _weights(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(H, N, R, generator=gen, dtype=torch.float64), torch.randn(H, V, R, generator=gen, dtype=torch.float64)


def _store(lens: list[int], gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Each sequence's latents and rope keys, written by mla_store_kv into shuffled blocks."""
    width = max(-(-n // PAGE) for n in lens)
    cache = torch.zeros(len(lens) * width + 1, PAGE, 1, R + P, dtype=torch.float64)
    ids = (torch.randperm(len(lens) * width, generator=gen) + 1).view(len(lens), width).to(torch.int32)
    latents, keys = [], []
    for b, n in enumerate(lens):
        latents.append(torch.randn(n, R, generator=gen, dtype=torch.float64))
        keys.append(torch.randn(n, P, generator=gen, dtype=torch.float64))
        slots = torch.tensor([int(ids[b, p // PAGE]) * PAGE + p % PAGE for p in range(n)])
        ref.mla_store_kv(latents[-1], keys[-1], cache, slots)
    return latents, keys, cache, ids


def test_decode_equals_dense_attention():
    gen = torch.Generator().manual_seed(0)
    lens = [9, 1, 6]
    latents, keys, cache, table = _store(lens, gen)
    w_uk, w_uv = _weights(gen)
    q_nope = torch.randn(len(lens), H, N, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(len(lens), H, P, generator=gen, dtype=torch.float64)
    q_latent = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
    out = ref.mla_decode_attention(q_latent, q_pe, cache, table, torch.tensor(lens, dtype=torch.int32), 0.3)
    got = torch.einsum("bhr,hvr->bhv", out, w_uv)
    for b in range(len(lens)):
        expected = dense_mla(q_nope[b : b + 1], q_pe[b : b + 1], latents[b], keys[b], w_uk, w_uv, 0.3)[0]
        torch.testing.assert_close(got[b], expected, rtol=1e-5, atol=1e-5)  # fp32 math


def test_prefill_with_a_cached_prefix_equals_dense_causal_attention():
    """Sequence 0 computes its last 4 of 10 tokens (6 cached: a prefix hit or earlier chunks),
    sequence 1 all 5 of its tokens; each query sees the keys up to its own position."""
    gen = torch.Generator().manual_seed(1)
    lens, new = [10, 5], [4, 5]
    latents, keys, cache, table = _store(lens, gen)
    w_uk, w_uv = _weights(gen)
    t = sum(new)
    q_nope = torch.randn(t, H, N, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(t, H, P, generator=gen, dtype=torch.float64)
    q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
    cu = torch.tensor([0, new[0], t], dtype=torch.int32)
    out = ref.mla_prefill_attention(q_latent, q_pe, cache, cu, torch.tensor(lens, dtype=torch.int32), table, 0.3)
    got = torch.einsum("thr,hvr->thv", out, w_uv)
    for b, (s, e) in enumerate(((0, new[0]), (new[0], t))):
        expected = dense_mla(q_nope[s:e], q_pe[s:e], latents[b], keys[b], w_uk, w_uv, 0.3, lens[b] - new[b])
        torch.testing.assert_close(got[s:e], expected, rtol=1e-5, atol=1e-5)
