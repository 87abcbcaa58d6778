"""Decode-step benchmark on the GPU: eager vs CUDA graph vs compiled graph, per bucket.

Random-weight bf16 models shaped like Qwen2.5-1.5B / 7B. Prints a table and
writes JSON (GPU, torch, triton, date) under benchmarks/results/.

    python benchmarks/decode_graphs.py --shapes qwen2.5-1.5b,qwen2.5-7b --batches 1,8,32,64,256
    python benchmarks/decode_graphs.py --startup qwen2.5-1.5b   # cold then warm compile start-up
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingot.bench.decode import bench_decode, build_shape, decode_bench_runner  # noqa: E402
from ingot.bench.report import env_info, write_json  # noqa: E402
from ingot.config import EngineConfig  # noqa: E402


def startup_child(shape: str, batches: list[int], context: int) -> None:
    """Time model build + capture of every bucket with compile on (one process)."""
    from ingot.runner.graph_runner import DecodeGraphRunner

    device = torch.device("cuda")
    model, cfg = build_shape(shape, torch.bfloat16, device, context + 64)
    config, runner, per_seq = decode_bench_runner(model, cfg, EngineConfig(decode_compile=True), batches, context)
    t0 = time.perf_counter()
    graphs = DecodeGraphRunner(model, config, device, per_seq, runner.policy)
    graphs.capture_all()
    total = time.perf_counter() - t0
    print(json.dumps({"capture_all_s": total, "per_bucket": {b: [i.seconds_warmup, i.seconds_capture] for b, i in graphs.info.items()}}))


def startup(shape: str, batches: list[int], context: int) -> dict:
    cache = Path(tempfile.mkdtemp(prefix="ingot-startup-"))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"))
    out = {}
    for label in ("cold", "warm"):
        cmd = [sys.executable, __file__, "--startup-child", shape, "--batches", ",".join(map(str, batches)), "--context", str(context)]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode != 0:
            print(res.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"startup child failed ({label})")
        out[label] = json.loads(res.stdout.strip().splitlines()[-1])
        print(f"{shape} {label} start-up: capture of {len(batches)} compiled buckets took {out[label]['capture_all_s']:.1f}s", flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-7b")
    ap.add_argument("--batches", default="1,8,32,64,256")
    ap.add_argument("--context", type=int, default=512, help="cached tokens per sequence")
    ap.add_argument("--modes", default="eager,graph,compiled", help="any of eager,graph,compiled,gemm_only")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--skinny-rows", type=int, default=0,
                    help="EngineConfig.skinny_gemm_max_rows: batches up to this many rows use the Triton skinny GEMM")
    ap.add_argument("--startup", default=None, help="shape to time cold and warm compiled start-up for")
    ap.add_argument("--startup-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/decode_graphs-<date>.json)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.startup_child:
        startup_child(args.startup_child, batches, args.context)
        return
    report = {"env": env_info(), "context_len": args.context, "skinny_gemm_max_rows": args.skinny_rows, "shapes": {}}
    modes = args.modes.split(",")
    for shape in [s for s in args.shapes.split(",") if s]:
        model, cfg = build_shape(shape, torch.bfloat16, torch.device("cuda"), args.context + 64)
        rows = bench_decode(model, cfg, batches, args.context, modes, iters=args.iters,
                            config=EngineConfig(skinny_gemm_max_rows=args.skinny_rows))
        report["shapes"][shape] = [r.__dict__ for r in rows]
        print(f"\n{shape} (bf16, random weights, context {args.context}) — ms per decode step, median of {args.iters}")
        print(f"{'batch':>6} " + " ".join(f"{m:>10}" for m in modes) + f" {'graph/eager':>12} {'compiled/graph':>15} {'compile s':>10}")
        for r in rows:
            sp_g = r.ms.get("eager", float("nan")) / r.ms.get("graph", float("nan"))
            sp_c = r.ms.get("graph", float("nan")) / r.ms.get("compiled", float("nan"))
            print(f"{r.batch:>6} " + " ".join(f"{r.ms.get(m, float('nan')):>10.3f}" for m in modes)
                  + f" {sp_g:>11.2f}x {sp_c:>14.2f}x {r.warmup_s.get('compiled', 0.0):>10.1f}", flush=True)
        del model
        torch.cuda.empty_cache()
    if args.startup:
        report["startup"] = {args.startup: startup(args.startup, batches, args.context)}
    out = write_json(args.out or Path(__file__).parent / "results" / f"decode_graphs-{dt.date.today()}.json", report)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
