"""The reference attention ops with a sliding window and a logit soft-cap, against a dense
masked softmax built in the test (HF's convention: a query at p sees keys p - window + 1..p)."""

from __future__ import annotations

import pytest
import torch

from ingot.ops import reference as ref
from tests.ops.window_cases import decode_window_case, drop_outside_window, prefill_window_case


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (1, 0.0), (5, 0.0), (8, 2.0), (0, 1.5), (100, 0.0)])
def test_decode_window(window, softcap):
    gen = torch.Generator().manual_seed(window)
    lens = [1, 7, 19, 33]
    args, expected = decode_window_case(lens, 4, 2, 16, 4, gen)
    out = ref.decode_attention(*args, 0.3, window, softcap)
    torch.testing.assert_close(out, expected(window, 0.3, softcap), rtol=1e-5, atol=1e-5)
    if window:  # blocks wholly outside the window handed back (dummy entries) change nothing
        table = drop_outside_window(args[3], [n - 1 for n in lens], window, 4)
        out = ref.decode_attention(*args[:3], table, args[4], 0.3, window, softcap)
        torch.testing.assert_close(out, expected(window, 0.3, softcap), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (3, 0.0), (6, 0.0), (8, 3.0)])
def test_prefill_window_chunks_straddle_the_window(window, softcap):
    """Chunks whose queries straddle the window's edge: part of the cached prefix is visible
    to the chunk's last queries only, all of it to none (window < prefix)."""
    gen = torch.Generator().manual_seed(10 + window)
    q_lens, totals = [5, 1, 12, 9], [21, 14, 12, 30]
    args, expected = prefill_window_case(q_lens, totals, 4, 1, 16, 4, gen)
    out = ref.prefill_attention(*args, 0.25, window, softcap)
    torch.testing.assert_close(out, expected(window, 0.25, softcap), rtol=1e-5, atol=1e-5)
    if window:
        firsts = [n - m for m, n in zip(q_lens, totals)]
        table = drop_outside_window(args[7], firsts, window, 4)
        out = ref.prefill_attention(*args[:7], table, 0.25, window, softcap)
        torch.testing.assert_close(out, expected(window, 0.25, softcap), rtol=1e-5, atol=1e-5)


def test_decode_attention_rope_passes_the_window_on():
    gen = torch.Generator().manual_seed(3)
    args, _ = decode_window_case([9, 20], 2, 2, 8, 4, gen)
    q, k_cache, v_cache, table, seq_lens = args
    k, v = torch.randn(2, 2, 8, generator=gen), torch.randn(2, 2, 8, generator=gen)
    pos = seq_lens.long() - 1
    slots = torch.stack([table[b, p // 4].long() * 4 + p % 4 for b, p in enumerate(pos.tolist())])
    cos_sin = torch.randn(32, 8, generator=gen)
    fused = ref.decode_attention_rope(q, k, v, pos, cos_sin, k_cache.clone(), v_cache.clone(), slots, table, seq_lens,
                                      0.5, None, None, 0.0, 4, 2.5)
    qr, kr = ref.rotary_embedding(pos, q, k, cos_sin)
    ref.store_kv(kr, v, k_cache, v_cache, slots)
    torch.testing.assert_close(fused, ref.decode_attention(qr, k_cache, v_cache, table, seq_lens, 0.5, 4, 2.5))
