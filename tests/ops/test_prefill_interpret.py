"""Prefill attention in the Triton interpreter against the reference op: the fused kernel's
tiles, and each path of the prefill dispatch with CPU stand-ins of PyTorch's flash and cuDNN
attention (kernel_cases.py) ahead of the context kernel.
Gated by tests/ops/interpret_fixtures.py."""

from __future__ import annotations

import pytest
import torch

from ingot.ops import reference as ref
from tests.ops.interpret_fixtures import ENABLED, K  # noqa: F401  (K: the fixture)
from tests.ops.kernel_cases import (
    cudnn_sdpa_reference, mixed_prefill_lens, prefill_case, rel_err, varlen_attention_reference,
)

pytestmark = pytest.mark.skipif(not ENABLED, reason="set INGOT_TEST_TRITON_INTERPRET=1 (needs triton)")


def _prefill_case(q_lens, ctx_lens, hq, hkv, d, page, gen, dtype=torch.bfloat16):
    """Packed new tokens whose k/v are already stored; returns the op's arguments."""
    return prefill_case(q_lens, ctx_lens, hq, hkv, d, page, gen, dtype)


PREFILL_CASES = [
    # (q_lens, ctx_lens, Hq, Hkv, D, page)
    ([5], [5], 2, 2, 64, 16),
    ([130, 3, 17], [130, 3, 17], 4, 1, 64, 16),  # crosses a 128-row tile
    ([20, 9], [70, 40], 4, 2, 32, 16),  # chunked prefill: cached prefixes
    ([1, 33], [200, 33], 7, 1, 64, 8),  # a single new token after a long prefix
    ([40], [300], 2, 2, 48, 64),  # head dim not a power of two, big pages
]


@pytest.mark.parametrize("q_lens,ctx_lens,hq,hkv,d,page", PREFILL_CASES)
def test_prefill_attention(K, q_lens, ctx_lens, hq, hkv, d, page):
    gen = torch.Generator().manual_seed(8 + sum(q_lens))
    args = _prefill_case(q_lens, ctx_lens, hq, hkv, d, page, gen)
    scale = d**-0.5
    out = K.prefill_attention.prefill_attention(*args, scale)
    f = [a.float() if a.is_floating_point() else a for a in args]
    expected = ref.prefill_attention(*f, scale)
    assert out.dtype == args[0].dtype
    assert rel_err(out, expected) < 1e-2


def test_prefill_attention_square_tiles(K):
    """128 x 128 tiles (the H200's configuration at head dim 128): the diagonal tile is one key
    tile, and query tiles that end mid-tile."""
    gen = torch.Generator().manual_seed(12)
    args = _prefill_case([150, 20], [170, 20], 2, 1, 32, 16, gen)
    cfg = K.prefill_attention.PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
    out = K.prefill_attention.prefill_attention(*args, 32**-0.5, config=cfg)
    expected = ref.prefill_attention(*[a.float() if a.is_floating_point() else a for a in args], 32**-0.5)
    assert rel_err(out, expected) < 1e-2


def test_prefill_attention_wide_context_tiles(K):
    """Key tiles over the cached prefix wider and narrower than over the new tokens: full
    prefix tiles, a masked tail, and prefixes shorter than one tile."""
    gen = torch.Generator().manual_seed(13)
    args = _prefill_case([20, 9, 70, 1], [150, 40, 70, 17], 4, 2, 32, 16, gen)
    expected = ref.prefill_attention(*[a.float() if a.is_floating_point() else a for a in args], 32**-0.5)
    for cfg in (K.prefill_attention.PrefillConfig(64, 32, 4, 2, block_n_ctx=128),
                K.prefill_attention.PrefillConfig(64, 64, 4, 2, block_n_ctx=16, ctx_stages=5)):
        out = K.prefill_attention.prefill_attention(*args, 32**-0.5, config=cfg)
        assert rel_err(out, expected) < 1e-2, cfg


# (batch, max new, max cached, Hq, Hkv, D)
PATH_CASES = [
    (5, 40, 70, 4, 4, 64),  # GQA ratio 1
    (4, 33, 50, 8, 2, 32),  # ratio 4
    (4, 20, 90, 7, 1, 48),  # ratio 7, head dim not a power of two
]


@pytest.mark.parametrize("path", ["flash", "gather"])
@pytest.mark.parametrize("batch,max_new,max_ctx,hq,hkv,d", PATH_CASES)
def test_prefill_paths(K, monkeypatch, path, batch, max_new, max_ctx, hq, hkv, d):
    """Each path of the prefill dispatch, PyTorch's flash kernel replaced by a CPU stand-in
    of its contract: sequences with and without a cached prefix in one call; the flash
    path's context kernel folds the prefixes into flash's output (in the interpreter)."""
    monkeypatch.setattr(K.prefill_dispatch, "flash_varlen", varlen_attention_reference)
    gen = torch.Generator().manual_seed(batch * 10 + hq + d)
    q_lens, ctx_lens = mixed_prefill_lens(batch, max_new, max_ctx, gen)
    args = prefill_case(q_lens, ctx_lens, hq, hkv, d, 16, gen)
    out = K.prefill_dispatch.prefill_attention(*args, d**-0.5, path=path)
    expected = ref.prefill_attention(*[a.float() if a.is_floating_point() else a for a in args], d**-0.5)
    assert out.dtype == args[0].dtype
    assert rel_err(out, expected) < 1e-2


@pytest.mark.parametrize("sms", [1, 7])
def test_context_kernel_programs_take_several_tiles(K, monkeypatch, sms):
    """A batch of mostly new tokens gets one wave of context programs, each taking every
    ``groups``-th query tile of its sequence (16-row tiles here: several per program)."""
    monkeypatch.setattr(K.prefill_dispatch, "flash_varlen", varlen_attention_reference)
    monkeypatch.setattr(K.prefill_attention, "num_sms", lambda device: sms)
    gen = torch.Generator().manual_seed(40 + sms)
    # capacity 80 tokens: 2 x 153 new >= 3 x 80, "mostly new"; two sequences with a short prefix
    args = prefill_case([70, 50, 33], [74, 50, 40], 2, 1, 32, 16, gen, extra_cols=0)
    cfg = K.prefill_attention.PrefillConfig(16, 16, 4, 2)
    groups = K.prefill_attention.context_tile_groups(80, 3, 2, 16, 1, args[0].device)
    assert groups == (1 if sms == 1 else 2) and K.prefill_attention.context_tile_groups(80, 3, 2, 16, None, args[0].device) == 5
    expected = ref.prefill_attention(*[a.float() if a.is_floating_point() else a for a in args], 32**-0.5)
    out = K.prefill_dispatch.prefill_attention(*args, 32**-0.5, path="flash", config=cfg)
    assert rel_err(out, expected) < 1e-2


def test_context_kernel_reads_padded_lse(K, monkeypatch):
    """Older flash returns the log-sum-exp padded per sequence ([B, Hq, max_q]): rows within
    the sequence, not packed rows."""
    def padded(*a, **kw):
        return varlen_attention_reference(*a, **kw, padded_lse=True)

    monkeypatch.setattr(K.prefill_dispatch, "flash_varlen", padded)
    gen = torch.Generator().manual_seed(31)
    args = prefill_case([30, 5, 17], [90, 5, 60], 4, 2, 32, 16, gen)
    out = K.prefill_dispatch.prefill_attention(*args, 32**-0.5, path="flash")
    expected = ref.prefill_attention(*[a.float() if a.is_floating_point() else a for a in args], 32**-0.5)
    assert rel_err(out, expected) < 1e-2


@pytest.mark.parametrize("q_len,ctx_len,extra_cols", [(50, 50, 1), (40, 170, 1), (2, 33, 1), (48, 48, 0)])
def test_prefill_cudnn_path(K, monkeypatch, q_len, ctx_len, extra_cols):
    """One sequence: PyTorch's cuDNN attention (a CPU stand-in here) over the new tokens,
    then the context kernel over the cached prefix, if any (none can be cached when the new
    tokens fill the block-table row: then no log-sum-exp is asked for)."""
    monkeypatch.setattr(K.prefill_dispatch, "cudnn_sdpa", cudnn_sdpa_reference)
    gen = torch.Generator().manual_seed(q_len + ctx_len)
    args = prefill_case([q_len], [ctx_len], 8, 2, 32, 16, gen, extra_cols=extra_cols)
    out = K.prefill_dispatch.prefill_attention(*args, 32**-0.5, path="cudnn")
    expected = ref.prefill_attention(*[a.float() if a.is_floating_point() else a for a in args], 32**-0.5)
    assert rel_err(out, expected) < 1e-2
