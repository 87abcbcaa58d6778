"""The rotary and fused decode kernels on the model's special rotary tables, through the Triton
interpreter: SmolLM3's identity table (one row seen at every position: stride 0) and a
partial-rotary table (identity columns after the rotated ones). Gated by
tests/ops/interpret_fixtures.py, whose fixture ``K`` this file reuses."""

from __future__ import annotations

import pytest
import torch

from ingot.layers.rotary import RotaryEmbedding
from ingot.ops import reference as ref
from tests.ops.interpret_fixtures import ENABLED, K  # noqa: F401  (K: the fixture)
from tests.ops.kernel_cases import check_rope_decode, rope_decode_case

pytestmark = pytest.mark.skipif(not ENABLED, reason="set INGOT_TEST_TRITON_INTERPRET=1 (needs triton)")


@pytest.mark.parametrize("table", ["identity", "partial"])
def test_rope_kernels_on_model_tables(K, table):  # noqa: F811
    d, max_pos = 64, 64
    rotary = RotaryEmbedding.identity(d, max_pos) if table == "identity" else RotaryEmbedding(d, max_pos, 1e4, None, 48)
    cache = rotary.cos_sin_cache
    gen = torch.Generator().manual_seed(11)
    args = rope_decode_case([37, 1], 4, 2, d, 16, torch.bfloat16, gen)
    args[4] = cache
    check_rope_decode(K.decode_attention.decode_attention_rope, args)
    q = torch.randn(5, 4, d, generator=gen).to(torch.bfloat16)
    k = torch.randn(5, 2, d, generator=gen).to(torch.bfloat16)
    positions = torch.randint(0, max_pos, (5,), generator=gen)
    q_out, k_out = K.rotary.rotary_embedding(positions, q, k, cache)
    q_exp, k_exp = ref.rotary_embedding(positions, q, k, cache)
    assert torch.equal(q_out, q_exp) and torch.equal(k_out, k_exp)
    if table == "identity":
        assert torch.equal(q_out, q) and torch.equal(k_out, k)
