"""RMSNorm, fused add + RMSNorm and rotary rows of ``python -m benchmarks.kernels``: their
inputs and the ``--sweep elementwise`` grid of launch configurations."""

from __future__ import annotations

import itertools

import torch

from benchmarks.kernel_timing import BF16, DEV, time_row
from ingot.ops import reference as ref


def elementwise_cases(t: int, h: int) -> dict:
    """RMSNorm, fused add + RMSNorm and rotary at ``t`` tokens x hidden ``h`` (rotary: 28/4
    heads, d128, q/k strided slices of a fused qkv): per case the call (taking an optional
    launch configuration), the reference call, the bytes moved and the row labels."""
    from ingot.ops.triton import rms_norm, rotary

    x = torch.randn(t, h, dtype=BF16, device=DEV)
    r = torch.randn(t, h, dtype=BF16, device=DEV)
    w = torch.randn(h, dtype=BF16, device=DEV)
    hq, hkv, d = 28, 4, 128
    qkv = torch.randn(t, (hq + 2 * hkv) * d, dtype=BF16, device=DEV)
    q = qkv[:, : hq * d].view(t, hq, d)
    kk = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    cache = torch.randn(32768, d, device=DEV)
    pos = torch.randint(0, 32768, (t,), device=DEV)
    return {
        "rms_norm": dict(kernel="rms_norm", shape=f"{t}x{h}", nbytes=2 * t * h * 2,
                         fn=lambda cfg=None: rms_norm.rms_norm(x, w, 1e-6, cfg), ref=lambda: ref.rms_norm(x, w, 1e-6)),
        "add_rms_norm": dict(kernel="add_rms_norm", shape=f"{t}x{h}", nbytes=4 * t * h * 2,
                             fn=lambda cfg=None: rms_norm.add_rms_norm(x, r, w, 1e-6, cfg),
                             ref=lambda: ref.add_rms_norm(x, r, w, 1e-6)),
        "rotary": dict(kernel="rotary_embedding", shape=f"T{t} {hq}/{hkv} d{d} (strided)",
                       nbytes=2 * t * (hq + hkv) * d * 2 + t * d * 4 + t * 8,
                       fn=lambda cfg=None: rotary.rotary_embedding(pos, q, kk, cache, cfg),
                       ref=lambda: ref.rotary_embedding(pos, q, kk, cache)),
    }


def sweep_elementwise(copy_gbps: float, t: int = 4096, h: int = 3584) -> list:
    """Launch configurations of RMSNorm (rows per program, warps; the weight loaded last,
    as at this row count) and rotary (pairs per program, warps) on the 4096-token
    benchmark shapes; % of copy bandwidth."""
    from ingot.ops.triton import rms_norm, rotary

    print("\n# elementwise sweep: % of copy bandwidth (flushed-graph timing)")
    cases = elementwise_cases(t, h)
    norm_grid = [rms_norm.RmsNormConfig(r, nw, weight_first=False) for r, nw in itertools.product((1, 2, 4), (4, 8, 16))]
    grids = {
        "rms_norm": norm_grid,
        "add_rms_norm": norm_grid,
        "rotary": [rotary.RotaryConfig(e, nw) for e, nw in itertools.product((1024, 2048, 4096, 8192), (2, 4, 8))],
    }
    out = []
    for name, case in cases.items():
        for cfg in [None] + grids[name]:
            ms = time_row(lambda cfg=cfg: case["fn"](cfg))[0]
            pct = 100 * case["nbytes"] / (ms * 1e-3) / 1e9 / copy_gbps
            label = "default" if cfg is None else cfg
            out.append(dict(kernel=name, config=str(label), ms=ms, pct_of_copy=pct))
            print(f"  {name:<13} {str(label):<60} {ms * 1e3:7.2f} us {pct:6.1f}%")
        best = max((o for o in out if o["kernel"] == name), key=lambda o: o["pct_of_copy"])
        print(f"# best {name}: {best['config']} {best['pct_of_copy']:.1f}%")
    return out
