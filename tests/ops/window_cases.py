"""Sliding-window / soft-capped attention cases: paged inputs and a dense masked softmax built
here, independent of ingot's code (shared by the reference and the interpreter tests)."""

from __future__ import annotations

import torch


def dense_attention(q, k, v, q_pos, window: int, scale: float, softcap: float = 0.0, sinks=None) -> torch.Tensor:
    """q [Tq, Hq, D] at positions ``q_pos``, k/v [Tk, Hkv, D] at positions 0..Tk-1, fp32: key j
    is visible to a query at p iff j <= p and (window <= 0 or p - j < window). ``sinks`` [Hq]:
    exp(sink) joins each head's softmax denominator (gpt-oss's attention sinks)."""
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for i, p in enumerate(q_pos):
        keys = slice(max(0, p - window + 1) if window > 0 else 0, p + 1)  # j <= p, p - j < window
        for h in range(hq):
            kh, vh = k[keys, h // (hq // hkv)].float(), v[keys, h // (hq // hkv)].float()
            logits = (kh @ q[i, h].float()) * scale
            if softcap > 0:
                logits = softcap * torch.tanh(logits / softcap)
            if sinks is None:
                out[i, h] = torch.softmax(logits, 0) @ vh
            else:
                e = torch.exp(logits - logits.max())
                out[i, h] = (e @ vh) / (e.sum() + torch.exp(sinks[h].float() - logits.max()))
    return out


def paged_sequences(totals, page: int, hkv: int, d: int, gen, dtype=torch.float32, extra_cols: int = 1):
    """(per-sequence k, v [total, Hkv, D], k_cache, v_cache, block table): each sequence's K/V
    written into shuffled blocks of a paged cache (block 0 the dummy, unused columns 0)."""
    width = max(-(-n // page) for n in totals) + extra_cols
    num_blocks = len(totals) * width + 1
    k_cache = torch.randn(num_blocks, page, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, page, hkv, d, generator=gen).to(dtype)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(totals), width, dtype=torch.int32)
    ks, vs = [], []
    for b, n in enumerate(totals):
        k = torch.randn(n, hkv, d, generator=gen).to(dtype)
        v = torch.randn(n, hkv, d, generator=gen).to(dtype)
        for pos in range(n):
            if pos % page == 0:
                table[b, pos // page] = ids.pop()
            blk = int(table[b, pos // page])
            k_cache[blk, pos % page], v_cache[blk, pos % page] = k[pos], v[pos]
        ks.append(k)
        vs.append(v)
    return ks, vs, k_cache, v_cache, table


def prefill_window_case(q_lens, totals, hq, hkv, d, page, gen, dtype=torch.float32):
    """(the prefill op's arguments without scale, expected output per window function): sequence
    b's last ``q_lens[b]`` of ``totals[b]`` tokens are new (packed q, k, v; already in the cache)."""
    ks, vs, k_cache, v_cache, table = paged_sequences(totals, page, hkv, d, gen, dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    k = torch.cat([kb[n - m:] for kb, m, n in zip(ks, q_lens, totals)])
    v = torch.cat([vb[n - m:] for vb, m, n in zip(vs, q_lens, totals)])
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    args = [q, k, v, k_cache, v_cache, cu, torch.tensor(totals, dtype=torch.int32), table]

    def expected(window: int, scale: float, softcap: float = 0.0, sinks=None) -> torch.Tensor:
        parts = []
        for b, (m, n) in enumerate(zip(q_lens, totals)):
            qb = q[int(cu[b]):int(cu[b + 1])]
            parts.append(dense_attention(qb, ks[b], vs[b], list(range(n - m, n)), window, scale, softcap, sinks))
        return torch.cat(parts)

    return args, expected


def decode_window_case(lens, hq, hkv, d, page, gen, dtype=torch.float32):
    """(the decode op's arguments without scale, expected output per window function): one query
    per sequence, at its last position, over its ``lens[b]`` cached tokens."""
    ks, vs, k_cache, v_cache, table = paged_sequences(lens, page, hkv, d, gen, dtype)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    args = [q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32)]

    def expected(window: int, scale: float, softcap: float = 0.0, sinks=None) -> torch.Tensor:
        return torch.cat([dense_attention(q[b:b + 1], ks[b], vs[b], [n - 1], window, scale, softcap, sinks)
                          for b, n in enumerate(lens)])

    return args, expected


def drop_outside_window(table: torch.Tensor, first_queries, window: int, page: int) -> torch.Tensor:
    """The block table as the engine leaves it once blocks wholly before each sequence's window
    are handed back: those entries are the dummy block 0."""
    table = table.clone()
    for b, first in enumerate(first_queries):
        table[b, : max(0, first - window + 1) // page] = 0
    return table
