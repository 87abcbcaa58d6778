"""Sliding windows and soft-capping in the decode and prefill kernels (Triton interpreter),
and speculative decoding's verify rows through decode attention, against the dense masked
softmax (window_cases.py). Gated by tests/ops/interpret_fixtures.py."""

from __future__ import annotations

import pytest
import torch

from tests.ops.interpret_fixtures import ENABLED, K  # noqa: F401  (K: the fixture)
from tests.ops.kernel_cases import check_rope_decode, rel_err, rope_decode_case
from tests.ops.window_cases import decode_window_case, prefill_window_case

pytestmark = pytest.mark.skipif(not ENABLED, reason="set INGOT_TEST_TRITON_INTERPRET=1 (needs triton)")


def _poison_outside_window(cache_pair, table, first_queries, window, page):
    """NaN into every block wholly before each row's window: a kernel that reads one fails."""
    for b, first in enumerate(first_queries):
        for i in range(max(0, first - window + 1) // page):
            for cache in cache_pair:
                cache[int(table[b, i])] = float("nan")


@pytest.mark.parametrize("lens,page,window,softcap,splits", [
    ([1, 40, 70], 16, 24, 0.0, 3),  # the window starts mid-tile; slices over the window only
    ([70, 9], 8, 8, 0.0, None),
    ([50, 33], 16, 17, 2.0, 2),
    ([64, 20], 16, 0, 3.0, 1),  # soft-cap alone, direct write
])
def test_decode_attention_window(K, lens, page, window, softcap, splits):
    gen = torch.Generator().manual_seed(sum(lens) + window)
    args, expected = decode_window_case(lens, 4, 2, 32, page, gen)
    if window:
        _poison_outside_window(args[1:3], args[3], [n - 1 for n in lens], window, page)
    out = K.decode_attention.decode_attention(*args, 0.2, window, softcap, num_splits=splits)
    assert rel_err(out, expected(window, 0.2, softcap)) < 1e-4


def test_decode_attention_rope_window(K):
    gen = torch.Generator().manual_seed(21)
    args = rope_decode_case([70, 33, 1], 4, 2, 32, 16, torch.bfloat16, gen)
    check_rope_decode(lambda *a: K.decode_attention.decode_attention_rope(*a, num_splits=3), [*args, None, None, 0.0, 20, 5.0])


def test_choose_num_splits_within_a_window(K):
    f = K.decode_attention.choose_num_splits
    assert f(1, 2, 256, 16, 64, torch.device("cpu"), window=100) == 3  # the tiles 100 tokens can touch


@pytest.mark.parametrize("q_lens,totals,page,window,softcap", [
    ([5, 1, 12, 9], [21, 14, 12, 30], 4, 6, 0.0),  # chunks straddling the window's edge
    ([40, 20], [100, 20], 8, 24, 0.0),  # the window skips cached and new-token tiles
    ([33, 7], [80, 50], 8, 10, 1.5),
    ([30], [30], 8, 0, 2.0),  # soft-cap alone
])
def test_prefill_attention_window(K, q_lens, totals, page, window, softcap):
    gen = torch.Generator().manual_seed(sum(totals) + window)
    args, expected = prefill_window_case(q_lens, totals, 4, 2, 32, page, gen)
    if window:
        _poison_outside_window(args[3:5], args[7], [n - m for m, n in zip(q_lens, totals)], window, page)
    cfg = K.prefill_attention.PrefillConfig(16, 16, 4, 2)  # several query and key tiles per sequence
    out = K.prefill_attention.prefill_attention(*args, 0.2, window, softcap, config=cfg)
    assert rel_err(out, expected(window, 0.2, softcap)) < 1e-4
    out = K.prefill_dispatch.prefill_attention(*args, 0.2, window, softcap, config=cfg)  # the dispatch: this kernel
    assert rel_err(out, expected(window, 0.2, softcap)) < 1e-4


@pytest.mark.parametrize("window,softcap,sinks,splits", [
    (0, 0.0, False, None),
    (0, 0.0, False, 3),  # several slices: the rows of one sequence in different programs
    (6, 2.0, False, 2),  # each row's window starts one position later than the row before it
    (0, 0.0, True, 1),
])
def test_decode_attention_of_verify_rows(K, window, softcap, sinks, splits):
    """Speculative decoding's verify rows: sequence b's last ``q_lens[b]`` tokens as one decode
    row each (its block table repeated, ``seq_len = position + 1``) plus a padding row, their
    K/V stored first by the store_kv kernel into NaN slots: each row's decode attention equals
    dense causal attention at its position (the kernel reads the repeated table only)."""
    gen = torch.Generator().manual_seed(window + splits if splits else 31)
    q_lens, totals, page = [4, 1, 3], [21, 9, 3], 4
    (q, k, v, k_cache, v_cache, _, _, table), expected = prefill_window_case(q_lens, totals, 4, 2, 32, page, gen)
    rows = [(b, pos) for b, (m, n) in enumerate(zip(q_lens, totals)) for pos in range(n - m, n)]
    slots = torch.tensor([int(table[b, pos // page]) * page + pos % page for b, pos in rows] + [0])
    k_cache.view(-1, 2, 32)[slots[:-1]] = float("nan")  # read before the store: NaN in the output
    v_cache.view(-1, 2, 32)[slots[:-1]] = float("nan")
    pad = [torch.randn(1, *x.shape[1:], generator=gen) for x in (q, k, v)]
    q, k, v = (torch.cat([x, p]) for x, p in zip((q, k, v), pad))
    tables = torch.cat([table[[b for b, _ in rows]], torch.zeros(1, table.shape[1], dtype=torch.int32)])
    seq_lens = torch.tensor([pos + 1 for _, pos in rows] + [1], dtype=torch.int32)
    sink = torch.randn(4, generator=gen) if sinks else None
    K.kv_store.store_kv(k, v, k_cache, v_cache, slots)
    out = K.decode_attention.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.2, window, softcap, sink,
                                              num_splits=splits)
    assert rel_err(out[:-1], expected(window, 0.2, softcap, sink)) < 1e-4
