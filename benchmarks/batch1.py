"""Batch-1 decode: the skinny GEMM's prologue knobs against cuBLAS, whole steps, one run.

    python benchmarks/batch1.py [--shapes qwen2.5-1.5b,qwen2.5-7b] [--hf] [--out PATH]

At batch 1 the norm and SiLU run inside the skinny GEMVs (``rms_norm_linear``,
``silu_mul_linear``), and each N tile of a GEMV recomputes its prologue over
all of K. This times the graph-replayed step and its GEMM-only floor for:
cuBLAS (``skinny_gemm_max_rows=0``), and the skinny path with each
``skinny_gemm.CONFIG_OVERRIDE`` variant (``round``: integer or ``cvt``
rounding; ``prologue_block_n``: the tile width of GEMVs with a prologue;
``pdl``: programmatic dependent launch of the GEMVs and decode attention;
``norm_prologue_max_n``: ``layers.linear.NORM_PROLOGUE_MAX_N``). With
``--hf`` it also times HF transformers' static-cache compiled decode on the
first shape, so the speed-up is a ratio within one run. Prints a table, writes
JSON. Pick the defaults in ``skinny_gemm._config`` from the result.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingot.bench.decode import bench_decode, build_shape  # noqa: E402
from ingot.bench.report import env_info, write_json  # noqa: E402
from ingot.config import EngineConfig  # noqa: E402

CONTEXT = 512
# (label, skinny_gemm_max_rows, CONFIG_OVERRIDE). Fusing only one of the two prologues was measured
# (2026-11-30, results/batch1-*): each one alone is slower than both, so both are always on.
VARIANTS = [
    ("cuBLAS", 0, {}),
    ("default", 1, {}),
    ("pro16", 1, {"prologue_block_n": 16}),
    ("pro64", 1, {"prologue_block_n": 64}),
    ("pro128", 1, {"prologue_block_n": 128}),
    ("cvt", 1, {"round": "cvt"}),
    # (the "defer" variants of the fourth session, all slower: batch1-knobs-2026-11-30.json; knob removed)
    # the norm fused into gate/up too (the default before NORM_PROLOGUE_MAX_N)
    ("gate_up norm", 1, {"norm_prologue_max_n": 1 << 30}),
]
# knobs that are not skinny_gemm.CONFIG_OVERRIDE keys
_LAYER_KNOBS = ("norm_prologue_max_n",)


def run(shapes: list[str], iters: int, hf: bool, rounds: int, variants: list = VARIANTS) -> dict:
    """Every variant ``rounds`` times, interleaved (so drift of a shared GPU hits all alike);
    each variant's best round is its figure."""
    from ingot.layers import linear
    from ingot.ops.triton import decode_attention, skinny_gemm

    default_max_n = linear.NORM_PROLOGUE_MAX_N

    report = {"env": env_info(), "context_len": CONTEXT, "rounds": rounds, "shapes": {}}
    for i, shape in enumerate(shapes):
        model, cfg = build_shape(shape, torch.bfloat16, torch.device("cuda"), CONTEXT + 64)
        runs: dict[str, list[tuple[float, float]]] = {label: [] for label, _, _ in variants}
        for r in range(rounds):
            for label, skinny_rows, knobs in variants:
                skinny_gemm.CONFIG_OVERRIDE.clear()
                skinny_gemm.CONFIG_OVERRIDE.update({k: v for k, v in knobs.items() if k not in _LAYER_KNOBS})
                linear.NORM_PROLOGUE_MAX_N = knobs.get("norm_prologue_max_n", default_max_n)
                decode_attention.CONFIG_OVERRIDE.clear()
                decode_attention.CONFIG_OVERRIDE.update({k: v for k, v in knobs.items() if k == "pdl"})
                (timing,) = bench_decode(model, cfg, [1], CONTEXT, ["graph", "gemm_only"], iters=iters,
                                         config=EngineConfig(skinny_gemm_max_rows=skinny_rows))
                runs[label].append((timing.ms["graph"], timing.ms["gemm_only"]))
                print(f"  {shape:>13} round {r} {label:<16} graph {runs[label][-1][0]:.3f} ms"
                      f"  GEMM-only {runs[label][-1][1]:.3f} ms", flush=True)
        skinny_gemm.CONFIG_OVERRIDE.clear()
        decode_attention.CONFIG_OVERRIDE.clear()
        linear.NORM_PROLOGUE_MAX_N = default_max_n
        rows = []
        print(f"\n  {shape}: best of {rounds} rounds")
        for label, _, knobs in variants:
            graph_ms = min(g for g, _ in runs[label])
            gemm_ms = min(m for _, m in runs[label])
            rows.append(dict(variant=label, knobs=knobs, graph_ms=graph_ms, gemm_only_ms=gemm_ms,
                             step_minus_gemm_ms=graph_ms - gemm_ms, rounds=runs[label]))
            print(f"  {shape:>13} {label:<16} graph {graph_ms:.3f} ms  GEMM-only {gemm_ms:.3f} ms"
                  f"  step - GEMMs {graph_ms - gemm_ms:.3f} ms", flush=True)
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
    ap.add_argument("--rounds", type=int, default=2, help="passes over the variants (best per variant)")
    ap.add_argument("--variants", default=None, help="comma-separated labels of VARIANTS to run (default: all)")
    ap.add_argument("--hf", action="store_true", help="also time HF transformers (static cache + compile) on the first shape")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/batch1-<date>.json)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/batch1.py needs a CUDA GPU")
    variants = VARIANTS
    if args.variants:
        wanted = args.variants.split(",")
        unknown = set(wanted) - {label for label, _, _ in VARIANTS}
        if unknown:
            sys.exit(f"unknown variants {sorted(unknown)}; known: {[label for label, _, _ in VARIANTS]}")
        variants = [v for v in VARIANTS if v[0] in wanted]
    report = run([s for s in args.shapes.split(",") if s], args.iters, args.hf, args.rounds, variants)
    out = write_json(args.out or Path(__file__).parent / "results" / f"batch1-{dt.date.today()}.json", report)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
