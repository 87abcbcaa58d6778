"""Decode attention in the Triton interpreter against the reference ops: plain, with rotary,
the KV store and Qwen3's head norms fused in, split counts and the merge kernel.
Gated by tests/ops/interpret_fixtures.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ingot.ops import reference as ref
from tests.ops.interpret_fixtures import ENABLED, K  # noqa: F401  (K: the fixture)
from tests.ops.kernel_cases import check_rope_decode, rel_err, rope_decode_case
from tests.ops.kernel_cases import paged as _paged

pytestmark = pytest.mark.skipif(not ENABLED, reason="set INGOT_TEST_TRITON_INTERPRET=1 (needs triton)")


def paged(lens, page, hkv, d, dtype, gen, extra_cols=1):
    return _paged(lens, page, hkv, d, dtype, gen, extra_cols)


DECODE_CASES = [
    # (Hq, Hkv, D, page, lens, splits)
    (4, 4, 64, 16, [1, 37], None),
    (8, 2, 64, 16, [100, 1, 17], 3),
    (7, 1, 128, 16, [130, 65], 4),
    (8, 1, 64, 16, [16, 32, 33], 64),  # more splits than tiles: empty slices
    (16, 2, 32, 128, [300], None),  # page larger than the tile
    (4, 2, 64, 8, [1, 1, 1, 1], 1),  # padding rows only, direct write
    (6, 2, 48, 16, [50, 3], 2),  # head dim not a power of two
]


@pytest.mark.parametrize("hq,hkv,d,page,lens,splits", DECODE_CASES)
def test_decode_attention(K, hq, hkv, d, page, lens, splits):
    gen = torch.Generator().manual_seed(hash((hq, hkv, d, page, len(lens))) & 0xFFFF)
    k_cache, v_cache, table = paged(lens, page, hkv, d, torch.bfloat16, gen)
    q = torch.randn(len(lens), hq, d, generator=gen).to(torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = d**-0.5
    out = K.decode_attention.decode_attention(q, k_cache, v_cache, table, seq_lens, scale, num_splits=splits)
    expected = ref.decode_attention(q.float(), k_cache.float(), v_cache.float(), table, seq_lens, scale)
    assert out.dtype == q.dtype
    assert rel_err(out, expected) < 1e-2


ROPE_DECODE_CASES = [
    # (Hq, Hkv, D, page, lens, splits)
    (4, 2, 64, 16, [37, 1], None),
    (8, 2, 64, 16, [100, 17, 16, 1], 3),  # new token first of its tile / block
    (7, 1, 128, 16, [130, 65, 1], 4),
    (4, 4, 32, 8, [64, 65, 1], 64),  # more splits than tiles
    (8, 2, 64, 16, [129, 1], 1),  # direct write
]


@pytest.mark.parametrize("hq,hkv,d,page,lens,splits", ROPE_DECODE_CASES)
def test_decode_attention_rope(K, hq, hkv, d, page, lens, splits):
    gen = torch.Generator().manual_seed(hash((hq, d, page, len(lens))) & 0xFFFF)
    args = rope_decode_case(lens, hq, hkv, d, page, torch.bfloat16, gen)
    check_rope_decode(lambda *a: K.decode_attention.decode_attention_rope(*a, num_splits=splits), args)


@pytest.mark.parametrize("hq,hkv,d,page,lens,splits", [ROPE_DECODE_CASES[1], ROPE_DECODE_CASES[2], ROPE_DECODE_CASES[4]])
def test_decode_attention_rope_with_head_norms(K, hq, hkv, d, page, lens, splits):
    """Qwen3's per-head q/k RMSNorm folded into the fused decode kernel, against the reference
    ops in sequence (norm, rotary, store, attention)."""
    gen = torch.Generator().manual_seed(hash((hq, d, page, len(lens), "norm")) & 0xFFFF)
    args = rope_decode_case(lens, hq, hkv, d, page, torch.bfloat16, gen, qk_norm=True)
    check_rope_decode(lambda *a: K.decode_attention.decode_attention_rope(*a, num_splits=splits), args)


def test_decode_attention_rope_needs_both_head_norms(K):
    gen = torch.Generator().manual_seed(2)
    args = rope_decode_case([9, 1], 4, 2, 32, 16, torch.bfloat16, gen, qk_norm=True)
    with pytest.raises(ValueError, match="both weights or neither"):
        K.decode_attention.decode_attention_rope(*args[:11], args[11], None, args[13])


def test_decode_merge_kernel_fallback(K):
    """The separate merge kernel (used when the split counters are unavailable) agrees."""
    gen = torch.Generator().manual_seed(8)
    args = rope_decode_case([90, 33, 1], 8, 2, 64, 16, torch.bfloat16, gen)
    cfg = replace(K.decode_attention.launch_config(64, 3 * 2, torch.device("cpu")), merge_kernel=True)
    check_rope_decode(lambda *a: K.decode_attention.decode_attention_rope(*a, num_splits=4, config=cfg), args)


def test_decode_zero_length_is_finite(K):
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache, table = paged([5, 3], 16, 2, 64, torch.bfloat16, gen)
    q = torch.randn(2, 4, 64, generator=gen).to(torch.bfloat16)
    for splits in (1, 3):
        out = K.decode_attention.decode_attention(
            q, k_cache, v_cache, table, torch.tensor([0, 3], dtype=torch.int32), 0.125, num_splits=splits
        )
        assert torch.isfinite(out.float()).all()
        assert (out[0] == 0).all()


def test_choose_num_splits(K):
    cpu = torch.device("cpu")
    f = K.decode_attention.choose_num_splits
    assert f(256, 8, 256, 16, 64, cpu) == 1  # plenty of programs already
    assert f(1, 2, 256, 16, 64, cpu) == K.decode_attention.MAX_SPLITS
    assert f(1, 2, 2, 16, 64, cpu) == 1  # a 32-token table is a single tile
    assert 1 < f(64, 2, 128, 16, 64, cpu) <= 8
