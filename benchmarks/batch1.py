"""Batch-1 decode: the skinny GEMM's prologue knobs against cuBLAS, whole steps, one run.

    python benchmarks/batch1.py [--shapes qwen2.5-1.5b,qwen2.5-7b] [--hf] [--out PATH]

At batch 1 the norm and SiLU run inside the skinny GEMVs (``rms_norm_linear``,
``silu_mul_linear``), and each N tile of a GEMV recomputes its prologue over
all of K. This times the graph-replayed step and its GEMM-only floor for:
cuBLAS (``skinny_gemm_max_rows=0``), and the skinny path with each
``skinny_gemm.CONFIG_OVERRIDE`` variant (``round``: integer or ``cvt``
rounding; ``prologue_block_n``: the tile width of GEMVs with a prologue;
``pdl``: programmatic dependent launch of the GEMVs and decode attention). With
``--hf`` it also times HF transformers' static-cache compiled decode on the
first shape, so the speed-up is a ratio within one run. Prints a table, writes
JSON. Pick the defaults in ``skinny_gemm._config`` from the result.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import sys
from pathlib import Path
from typing import Iterator, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingot.bench.decode import bench_decode, build_shape  # noqa: E402
from ingot.bench.report import env_info, write_json  # noqa: E402
from ingot.config import EngineConfig  # noqa: E402

CONTEXT = 512
# (label, skinny_gemm_max_rows, CONFIG_OVERRIDE); "fuse" (not a kernel knob) limits which
# prologues the layers fuse, by swapping the other's helper in ingot.models.llama for the unfused form
VARIANTS = [
    ("cuBLAS", 0, {}),
    ("skinny int/16", 1, {}),
    ("skinny norm only", 1, {"fuse": "norm"}),
    ("skinny silu only", 1, {"fuse": "silu"}),
    ("skinny cvt/16", 1, {"round": "cvt"}),
    ("skinny int/32", 1, {"prologue_block_n": 32}),
    ("skinny cvt/32", 1, {"round": "cvt", "prologue_block_n": 32}),
    ("skinny cvt/64", 1, {"round": "cvt", "prologue_block_n": 64}),
    ("skinny int/16 + PDL", 1, {"pdl": True}),
    ("skinny cvt/32 + PDL", 1, {"round": "cvt", "prologue_block_n": 32, "pdl": True}),
]


def run(shapes: list[str], iters: int, hf: bool) -> dict:
    from ingot.ops.triton import decode_attention, skinny_gemm

    report = {"env": env_info(), "context_len": CONTEXT, "shapes": {}}
    for i, shape in enumerate(shapes):
        model, cfg = build_shape(shape, torch.bfloat16, torch.device("cuda"), CONTEXT + 64)
        rows = []
        for label, skinny_rows, knobs in VARIANTS:
            skinny_gemm.CONFIG_OVERRIDE.clear()
            skinny_gemm.CONFIG_OVERRIDE.update({k: v for k, v in knobs.items() if k != "fuse"})
            decode_attention.CONFIG_OVERRIDE.clear()
            decode_attention.CONFIG_OVERRIDE.update({k: v for k, v in knobs.items() if k == "pdl"})
            with _only_fused(knobs.get("fuse")):
                (timing,) = bench_decode(model, cfg, [1], CONTEXT, ["graph", "gemm_only"], iters=iters,
                                         config=EngineConfig(skinny_gemm_max_rows=skinny_rows))
            rows.append(dict(variant=label, knobs=knobs, graph_ms=timing.ms["graph"], gemm_only_ms=timing.ms["gemm_only"],
                             step_minus_gemm_ms=timing.ms["graph"] - timing.ms["gemm_only"]))
            print(f"  {shape:>13} {label:<15} graph {rows[-1]['graph_ms']:.3f} ms  GEMM-only {rows[-1]['gemm_only_ms']:.3f} ms"
                  f"  step - GEMMs {rows[-1]['step_minus_gemm_ms']:.3f} ms", flush=True)
        skinny_gemm.CONFIG_OVERRIDE.clear()
        decode_attention.CONFIG_OVERRIDE.clear()
        entry = {"variants": rows}
        if hf and i == 0:
            entry["hf_static_compiled_ms"] = _hf_ms(shape, iters)
            best = min(r["graph_ms"] for r in rows)
            print(f"  {shape:>13} HF static cache + compile {entry['hf_static_compiled_ms']:.3f} ms: "
                  f"best ingot variant {entry['hf_static_compiled_ms'] / best:.2f}x faster", flush=True)
        report["shapes"][shape] = entry
        del model
        torch.cuda.empty_cache()
    return report


@contextlib.contextmanager
def _only_fused(which: Optional[str]) -> Iterator[None]:
    """Keep only the ``which`` prologue fused ("norm" or "silu"; None: both)."""
    import ingot.models.llama as llama

    saved = llama.norm_linear, llama.silu_mul_linear
    if which == "norm":
        llama.silu_mul_linear = lambda x, act, proj: proj(act(x))
    elif which == "silu":
        def unfused_norm(x, residual, norm, proj):
            h, residual = norm(x, residual)
            return proj(h), residual

        llama.norm_linear = unfused_norm
    try:
        yield
    finally:
        llama.norm_linear, llama.silu_mul_linear = saved


def _hf_ms(shape: str, iters: int) -> float:
    from ingot.bench.hf_compare import build_hf_model, hf_decode_ms

    model = build_hf_model(None, shape, torch.bfloat16, torch.device("cuda"))
    try:
        return hf_decode_ms(model, 1, CONTEXT, iters, compile=True)
    finally:
        del model
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-7b")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--hf", action="store_true", help="also time HF transformers (static cache + compile) on the first shape")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/batch1-<date>.json)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/batch1.py needs a CUDA GPU")
    report = run([s for s in args.shapes.split(",") if s], args.iters, args.hf)
    out = write_json(args.out or Path(__file__).parent / "results" / f"batch1-{dt.date.today()}.json", report)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
