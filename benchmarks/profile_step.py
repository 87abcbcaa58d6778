"""Where a captured decode step spends its time: kernels per step, grouped by name.

Runs graph replays (no compile) of a random-weight model shape under
``torch.profiler`` and prints, per batch size, each kernel's launches per step
and GPU microseconds per step, plus the sum of kernel time against the measured
step time (the difference is the gaps between graph nodes). Writes JSON.

    python benchmarks/profile_step.py --shape qwen2.5-1.5b --batches 1,64
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingot.bench.decode import build_shape, decode_bench_runner, synthetic_decode_inputs, time_cuda  # noqa: E402
from ingot.bench.report import env_info, write_json  # noqa: E402
from ingot.config import EngineConfig  # noqa: E402
from ingot.runner.graph_runner import DecodeGraphRunner  # noqa: E402


def short(name: str) -> str:
    """Kernel names collapsed to their family (cuBLAS GEMMs share one label)."""
    low = name.lower()
    if "gemm" in low or "gemv" in low or "cutlass" in low or "sm90" in low or "nvjet" in low:
        return "GEMM"
    return name[:60]


def profile(shape: str, batches: list[int], context: int, steps: int) -> dict:
    device = torch.device("cuda")
    model, cfg = build_shape(shape, torch.bfloat16, device, context + 64)
    config, runner, per_seq = decode_bench_runner(model, cfg, EngineConfig.create(), batches, context)  # INGOT_* apply
    graphs = DecodeGraphRunner(model, config, device, per_seq, runner.policy)
    graphs.capture_all()
    out = {}
    for b in batches:
        inputs = synthetic_decode_inputs(b, context, config.block_size, device, cfg.vocab_size)
        with torch.inference_mode():
            step_ms = time_cuda(lambda: graphs.run(inputs), 30)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    graphs.run(inputs)
                torch.cuda.synchronize()
        agg: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                key = short(ev.name)
                agg[key][0] += 1
                agg[key][1] += ev.device_time_total
        rows = sorted(((k, n / steps, us / steps) for k, (n, us) in agg.items()), key=lambda r: -r[2])
        total_us = sum(r[2] for r in rows)
        print(f"\n{shape} batch {b}: step {step_ms * 1e3:.1f} us, kernels {total_us:.1f} us "
              f"({sum(r[1] for r in rows):.0f} launches), gaps {step_ms * 1e3 - total_us:.1f} us")
        for k, n, us in rows[:20]:
            print(f"  {us:8.1f} us {n:6.0f}x  {k}")
        out[b] = {"step_us": step_ms * 1e3, "kernel_us": total_us, "kernels": rows}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = {"env": env_info(), "shape": args.shape, "context": args.context,
           "batches": profile(args.shape, [int(b) for b in args.batches.split(",")], args.context, args.steps)}
    if args.out:
        write_json(args.out, res)


if __name__ == "__main__":
    main()
