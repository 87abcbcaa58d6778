"""Skinny GEMM rows of ``python -m benchmarks.kernels``: each decode-step projection against
cuBLAS, the fused prologues' cost, and the ``--sweep skinny|skinny7b|skinny-moe`` tile grids."""

from __future__ import annotations

import itertools
from typing import Optional

import torch

from benchmarks.kernel_timing import BF16, DEV, bench_graph_us

# decode-step projections (N, K) per layer, and lm_head, of the benchmark shapes
PROJECTIONS = {
    "1.5b": dict(qkv=(2048, 1536), o=(1536, 1536), gate_up=(17920, 1536), down=(1536, 8960), lm_head=(151936, 1536)),
    "7b": dict(qkv=(4608, 3584), o=(3584, 3584), gate_up=(37888, 3584), down=(3584, 18944), lm_head=(152064, 3584)),
}
LAYERS = 28
# the attention projections and the router of the MoE benchmark shapes (their experts run fused_moe)
MOE_PROJECTIONS = {
    "qwen3-30b-a3b": dict(qkv=(5120, 2048), o=(2048, 4096), router=(128, 2048)),
    "mixtral-8x7b": dict(qkv=(6144, 4096), o=(4096, 4096), router=(8, 4096)),
}


def skinny_rows() -> list:
    """ops/triton/skinny_gemm.py against torch.nn.functional.linear (cuBLAS), each replayed
    from a CUDA graph; and the whole step's GEMMs projected (28 layers + lm_head)."""
    from ingot.ops.triton import skinny_gemm

    print("\n# skinny GEMM (graph replay, us) vs F.linear; GB/s of weight read")
    out = []
    for shape, projs in PROJECTIONS.items():
        for m in (1, 8, 16):
            step = {"skinny": 0.0, "cublas": 0.0}
            for name, (n, k) in projs.items():
                w = torch.randn(n, k, dtype=BF16, device=DEV) * 0.02
                x = torch.randn(m, k, dtype=BF16, device=DEV)
                us_s = bench_graph_us(lambda x=x, w=w: skinny_gemm.skinny_linear(x, w, None))
                us_c = bench_graph_us(lambda x=x, w=w: torch.nn.functional.linear(x, w))
                err = (skinny_gemm.skinny_linear(x, w, None).float() - torch.nn.functional.linear(x, w).float()).norm()
                rel = float(err / torch.nn.functional.linear(x, w).float().norm())
                times = 1 if name == "lm_head" else LAYERS
                step["skinny"] += times * us_s
                step["cublas"] += times * us_c
                gbps = lambda us: n * k * 2 / (us * 1e-6) / 1e9  # noqa: E731
                out.append(dict(shape=shape, m=m, proj=name, n=n, k=k, skinny_us=us_s, cublas_us=us_c, rel_err=rel))
                print(f"  {shape:>4} M{m:<3} {name:<8} {n:>6}x{k:<6} skinny {us_s:8.2f} us {gbps(us_s):6.0f} GB/s | "
                      f"cuBLAS {us_c:8.2f} us {gbps(us_c):6.0f} GB/s | {us_c / us_s:5.2f}x  rel err {rel:.1e}")
                del w
            out.append(dict(shape=shape, m=m, proj="step (28 layers + lm_head)", skinny_us=step["skinny"], cublas_us=step["cublas"]))
            print(f"  {shape:>4} M{m:<3} step GEMMs: skinny {step['skinny'] / 1e3:.3f} ms vs cuBLAS {step['cublas'] / 1e3:.3f} ms "
                  f"({step['cublas'] / step['skinny']:.2f}x)")
    torch.cuda.empty_cache()
    return out


def prologue_rows() -> list:
    """What each fused prologue costs at one row: the projection with its prologue, the
    plain GEMV on the same weight, and the unfused pair (the elementwise op, then the
    GEMV), each replayed from a CUDA graph. (The step's GEMM-only reference runs the
    plain GEMVs; a prologue pays off when fused < unfused, and costs fused - plain.)"""
    from ingot.ops.triton import activation, rms_norm, skinny_gemm

    print("\n# prologues at M=1 (graph replay, us): fused | plain GEMV | unfused (op + GEMV)")
    out = []
    for shape, projs in PROJECTIONS.items():
        hidden = projs["o"][1]
        x = torch.randn(1, hidden, dtype=BF16, device=DEV)
        r = torch.randn(1, hidden, dtype=BF16, device=DEV)
        nw = torch.randn(hidden, dtype=BF16, device=DEV)
        for name in ("qkv", "gate_up", "down"):
            n, k = projs[name]
            w = torch.randn(n, k, dtype=BF16, device=DEV) * 0.02
            if name == "down":
                gu = torch.randn(1, 2 * k, dtype=BF16, device=DEV)
                act = torch.randn(1, k, dtype=BF16, device=DEV)
                fused = lambda gu=gu, w=w: skinny_gemm.silu_mul_linear(gu, w, None)  # noqa: E731
                plain = lambda act=act, w=w: skinny_gemm.skinny_linear(act, w, None)  # noqa: E731
                unfused = lambda gu=gu, w=w: skinny_gemm.skinny_linear(activation.silu_and_mul(gu), w, None)  # noqa: E731
            else:
                fused = lambda w=w: skinny_gemm.rms_norm_linear(x, r, nw, 1e-6, w, None)  # noqa: E731
                plain = lambda w=w: skinny_gemm.skinny_linear(x, w, None)  # noqa: E731
                unfused = lambda w=w: skinny_gemm.skinny_linear(rms_norm.add_rms_norm(x, r, nw, 1e-6)[0], w, None)  # noqa: E731
            us = {label: bench_graph_us(fn) for label, fn in (("fused", fused), ("plain", plain), ("unfused", unfused))}
            out.append(dict(shape=shape, proj=name, n=n, k=k, **{f"{key}_us": v for key, v in us.items()}))
            print(f"  {shape:>4} {name:<8} {n:>6}x{k:<6} fused {us['fused']:7.2f} | plain {us['plain']:7.2f} | "
                  f"unfused {us['unfused']:7.2f}  prologue cost {us['fused'] - us['plain']:+6.2f} us")
            del w
    torch.cuda.empty_cache()
    return out


def skinny_sweeps(sweep: Optional[str]) -> Optional[list]:
    """The skinny GEMM sweeps ``--sweep`` asks for (None: none)."""
    shapes = {"skinny": ["1.5b"], "skinny7b": ["7b"], "skinny-moe": list(MOE_PROJECTIONS),
              "all": ["1.5b", "7b", *MOE_PROJECTIONS]}.get(sweep or "", [])
    return [row for shape in shapes for row in _sweep_skinny(shape)] or None


def _sweep_skinny(shape: str = "1.5b") -> list:
    """Tile configurations of the skinny GEMM on one shape's projections. 1.5B: M=1 (the
    multiply-reduce form against tl.dot) and M=16 (tl.dot only). 7B: M=1 multiply-reduce
    only, with wider and deeper tiles (its down projection ran faster with 32-wide tiles
    and the SiLU prologue than plain with the 16-wide default: kernels-2026-11-30-s5.json).
    The MoE shapes (``MOE_PROJECTIONS``): M=1, both forms, after the launch the table
    picks today (``table``), the row to beat."""
    from ingot.ops.triton import skinny_gemm

    print(f"\n# skinny GEMM sweep, {shape} (graph replay us): M form BLOCK_N BLOCK_K warps waves")
    if shape in MOE_PROJECTIONS:
        cases = dict(MOE_PROJECTIONS[shape])
    else:
        names = ("qkv", "gate_up", "down") if shape == "1.5b" else ("qkv", "o", "gate_up", "down")
        cases = {name: PROJECTIONS[shape][name] for name in names}
    weights = {name: torch.randn(n, k, dtype=BF16, device=DEV) for name, (n, k) in cases.items()}
    out = []
    if shape in MOE_PROJECTIONS:
        table = dict(m=1, table=True, shape=shape)
        for name, w in weights.items():
            x = torch.randn(1, w.shape[1], dtype=BF16, device=DEV)
            table[name] = bench_graph_us(lambda x=x, w=w: skinny_gemm.skinny_linear(x, w, None))
        out.append(table)
        print("  table                      " + "  ".join(f"{n}: {table[n]:7.2f}" for n in cases))
        configs = itertools.product([(1, False), (1, True)], (16, 32, 64), (128, 256, 512), (4, 8), (1, 2, 4))
    elif shape == "1.5b":
        configs = itertools.product([(1, False), (1, True), (16, True)], (16, 32, 64, 128), (64, 128, 256), (4, 8), (1, 2, 4))
    else:
        configs = itertools.product([(1, False)], (16, 32, 64), (128, 256, 512), (4, 8), (1, 2, 4))
    for (m, dot), block_n, block_k, warps, waves in configs:
        cfg = skinny_gemm.SkinnyConfig(dot, block_n, block_k, warps, num_stages=4, waves=waves)
        res = dict(m=m, dot=dot, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=4, waves=waves, shape=shape)
        try:
            for name, w in weights.items():
                x = torch.randn(m, w.shape[1], dtype=BF16, device=DEV)
                res[name] = bench_graph_us(lambda x=x, w=w: skinny_gemm.skinny_linear(x, w, None, config=cfg))
        except Exception as exc:  # out of shared memory, ...
            res["error"] = type(exc).__name__
        out.append(res)
        print(f"  M{m:<2} {'dot' if dot else 'fma'} {block_n:4d} {block_k:4d} {warps:2d} {waves:2d}  " + "  ".join(
            f"{n}: {res[n]:7.2f}" for n in cases if n in res) + f" {res.get('error', '')}")
    for m in (1, 16):
        ok = [r for r in out if "error" not in r and r["m"] == m and not r.get("table")]
        if ok:
            print(f"# best skinny config at M{m}, {shape} (sum over cases): {min(ok, key=lambda r: sum(r[n] for n in cases))}")
    del weights
    torch.cuda.empty_cache()
    return out
