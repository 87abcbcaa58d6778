"""The latent-attention kernels (ops/triton/mla_attention.py) against their references, through the
Triton interpreter. Gated by tests/ops/interpret_fixtures.py, whose fixture ``K`` this file reuses."""

from __future__ import annotations

import pytest
import torch

from ingot.ops import reference_mla as ref
from tests.ops.interpret_fixtures import ENABLED, K  # noqa: F401  (K: the fixture)
from tests.ops.kernel_cases import rel_err
from tests.ops.mla_cases import mla_case

pytestmark = pytest.mark.skipif(not ENABLED, reason="set INGOT_TEST_TRITON_INTERPRET=1 (needs triton)")

DECODE_CASES = [
    # (heads, rank, rope, page, lens, splits)
    (4, 32, 16, 16, [37, 1], None),
    (5, 24, 8, 8, [20, 3, 9], 3),  # neither part a power of two wide (24) nor 16 (8); heads < a block
    (18, 32, 16, 16, [40, 16], 8),  # two head blocks; more slices than tiles: empty slices
    (4, 32, 16, 4, [33], 1),  # pages smaller than the tile
]


@pytest.mark.parametrize("heads,rank,rope,page,lens,splits", DECODE_CASES)
def test_mla_decode_attention(K, heads, rank, rope, page, lens, splits):  # noqa: F811
    gen = torch.Generator().manual_seed(hash((heads, rank, page, len(lens))) & 0xFFFF)
    q_latent, q_pe, cache, table = mla_case(lens, heads, rank, rope, page, torch.bfloat16, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = K.mla_attention.mla_decode_attention(q_latent, q_pe, cache, table, seq_lens, 0.2, num_splits=splits)
    expected = ref.mla_decode_attention(q_latent.float(), q_pe.float(), cache.float(), table, seq_lens, 0.2)
    assert out.dtype == torch.bfloat16 and rel_err(out, expected) < 1e-2


def test_mla_prefill_attention(K):  # noqa: F811
    """Two sequences: the last 5 of 21 tokens (16 cached before) and all 7 of 7."""
    gen = torch.Generator().manual_seed(3)
    lens, new = [21, 7], [5, 7]
    q_latent, q_pe, cache, table = mla_case(lens, 4, 32, 16, 8, torch.bfloat16, gen, rows=6)
    cu = torch.tensor([0, new[0], sum(new)], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = (q_latent, q_pe, cache, cu, seq_lens, table, 0.2)
    out = K.mla_attention.mla_prefill_attention(*args)
    expected = ref.mla_prefill_attention(q_latent.float(), q_pe.float(), cache.float(), cu, seq_lens, table, 0.2)
    assert out.dtype == torch.bfloat16 and rel_err(out, expected) < 1e-2


def test_mla_store_kv(K):  # noqa: F811
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(4, 8, 1, 24 + 8, generator=gen).to(torch.bfloat16)
    expected = cache.clone()
    latent = torch.randn(6, 24, generator=gen).to(torch.bfloat16)
    k_pe = torch.randn(6, 1, 8, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([9, 10, 11, 30, 31, 0])
    K.mla_attention.mla_store_kv(latent, k_pe, cache, slots)
    ref.mla_store_kv(latent, k_pe, expected, slots)
    assert torch.equal(cache, expected)


def test_mla_decode_attention_of_verify_rows(K):  # noqa: F811
    """Speculative decoding's verify rows: the last 4 of 21 tokens of sequence 0 and the last 2 of
    7 of sequence 1 as one decode row each (the sequence's block table repeated, ``seq_len =
    position + 1``) equal the reference prefill of those tokens as causal chunks."""
    gen = torch.Generator().manual_seed(8)
    lens, new = [21, 7], [4, 2]
    q_latent, q_pe, cache, table = mla_case(lens, 4, 32, 16, 8, torch.bfloat16, gen, rows=3)
    rows = [(b, pos) for b, (m, n) in enumerate(zip(new, lens)) for pos in range(n - m, n)]
    tables = table[[b for b, _ in rows]]
    seq_lens = torch.tensor([pos + 1 for _, pos in rows], dtype=torch.int32)
    out = K.mla_attention.mla_decode_attention(q_latent, q_pe, cache, tables, seq_lens, 0.2, num_splits=2)
    cu = torch.tensor([0, new[0], sum(new)], dtype=torch.int32)
    expected = ref.mla_prefill_attention(q_latent.float(), q_pe.float(), cache.float(), cu,
                                         torch.tensor(lens, dtype=torch.int32), table, 0.2)
    assert rel_err(out, expected) < 1e-2
