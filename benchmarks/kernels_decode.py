"""Decode attention rows of ``python -m benchmarks.kernels``: paged-cache inputs and the
``--sweep decode`` grid of launch configurations."""

from __future__ import annotations

import itertools

import torch

from benchmarks.kernel_timing import BF16, DEV, bench, bench_graph_us


def paged_cache(batch, ctx, hkv, d, page=16, gen=None):
    blocks = -(-ctx // page)
    nb = batch * blocks + 1
    k_cache = torch.randn(nb, page, hkv, d, dtype=BF16, device=DEV)
    v_cache = torch.randn(nb, page, hkv, d, dtype=BF16, device=DEV)
    table = (torch.randperm(nb - 1, device=DEV)[: batch * blocks] + 1).view(batch, blocks).to(torch.int32)
    return k_cache, v_cache, table


def decode_case(batch, ctx, hq, hkv, d):
    k_cache, v_cache, table = paged_cache(batch, ctx, hkv, d)
    q = torch.randn(batch, hq, d, dtype=BF16, device=DEV)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    nbytes = 2 * batch * ctx * hkv * d * 2 + 2 * q.numel() * 2 + table.numel() * 4
    return (q, k_cache, v_cache, table, seq_lens, d**-0.5), nbytes


def rope_decode_case(batch, ctx, hq, hkv, d):
    """Arguments of decode_attention_rope: ``ctx`` tokens per sequence, the last one new."""
    (q, k_cache, v_cache, table, seq_lens, scale), nbytes = decode_case(batch, ctx, hq, hkv, d)
    k = torch.randn(batch, hkv, d, dtype=BF16, device=DEV)
    v = torch.randn(batch, hkv, d, dtype=BF16, device=DEV)
    positions = seq_lens.long() - 1
    slots = table.gather(1, (positions // 16)[:, None]).long().squeeze(1) * 16 + positions % 16
    cos_sin = torch.randn(ctx, d, device=DEV)
    return (q, k, v, positions, cos_sin, k_cache, v_cache, slots, table, seq_lens, scale), nbytes


def sweep_decode() -> list:
    """Tile configurations of the fused decode kernel (what the model runs): batch 64 at
    context 2048 (bandwidth) and batch 1 at context 512 (latency, timed in a graph)."""
    from ingot.ops.triton import decode_attention as mod

    print("\n# decode sweep (decode_attention_rope): BLOCK_N warps stages waves -> per case")
    out = []
    cases = {f"B64 {hq}/{hkv}": rope_decode_case(64, 2048, hq, hkv, 128) for hq, hkv in ((12, 2), (28, 4))}
    small = rope_decode_case(1, 512, 12, 2, 128)[0]
    for block_n, warps, stages, waves in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (1, 2, 4)):
        cfg = mod.DecodeConfig(block_n, warps, stages, waves)
        res = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages, waves=waves)
        try:
            for name, (call, nbytes) in cases.items():
                ms = bench(lambda c=call: mod.decode_attention_rope(*c, config=cfg), rep_ms=50)
                res[name] = dict(ms=ms, gbps=nbytes / (ms * 1e-3) / 1e9)
            res["B1 ctx512 us"] = bench_graph_us(lambda: mod.decode_attention_rope(*small, config=cfg))
        except Exception as exc:  # out of shared memory, ...
            res["error"] = type(exc).__name__
        out.append(res)
        cells = "  ".join(f"{n}: {r['gbps']:5.0f} GB/s" for n, r in res.items() if isinstance(r, dict))
        print(f"  {block_n:4d} {warps:2d} {stages:2d} {waves:2d}  {cells}  B1: {res.get('B1 ctx512 us', float('nan')):6.2f} us {res.get('error', '')}")
    ok = [r for r in out if "error" not in r]
    if ok:
        best = min(ok, key=lambda r: sum(r[n]["ms"] for n in cases))
        print(f"# best decode config at batch 64: {best}")
        print(f"# best decode config at batch 1: {min(ok, key=lambda r: r['B1 ctx512 us'])}")
    return out
