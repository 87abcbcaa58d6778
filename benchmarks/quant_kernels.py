"""Benchmark the quantized-weight kernels (int_linear, fp8_linear) against bf16 F.linear.

    python -m benchmarks.quant_kernels [--out PATH] [--shapes 1.5b,7b] [--batches 1,16,64,256]
                                       [--formats bf16,int4-g128,...] [--sweep]

Per projection of the 1.5B and 7B shapes (qkv, o, gate_up, down), batch (1, 16, 64, 256)
and format (bf16 ``F.linear``; int4 g128 with zero points; int8 g128; int8 per channel;
GGUF's Q4_1 and Q8_0 forms, groups of 32; fp8 128 x 128 blocks W8A16 and W8A8 per 128
columns; fp8 per channel W8A8 per token),
each kernel with its ``launch_config``: its time (median of CUDA-graph replays on a cold
L2, ``benchmarks.kernel_timing.bench_flushed_graph``), the bytes the format makes it read and
write (weights, scales and zero points, x, y: what the op cannot avoid; W8A8's fp8 copy of
x is not counted), GB/s and its % of the device-to-device copy bandwidth (read + write)
measured in the same run, TFLOP/s, and the speedup over bf16 at that shape. Prints a table
and writes JSON (default benchmarks/results/quant-kernels-<date>.json).

``--sweep`` also times each path over a grid of launch configurations at the 7B shapes
(int4 g128, the two GGUF forms and fp8 blocks W8A16 / W8A8, of those ``--formats`` names, at the ``--batches``:
the one-row GEMV at 1, the tl.dot GEMV up to 16, the GEMM above) and prints the best per
row, to retune the ``launch_config`` tables (each configuration compiles once: a few
hundred compilations for the whole grid, so sweep a format and a batch or two at a time).
GPU only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from ingot.bench.report import write_json

RESULTS = Path(__file__).resolve().parent / "results"
BF16 = torch.bfloat16
SHAPES = {
    "1.5b": dict(qkv=(2048, 1536), o=(1536, 1536), gate_up=(17920, 1536), down=(1536, 8960)),
    "7b": dict(qkv=(4608, 3584), o=(3584, 3584), gate_up=(37888, 3584), down=(3584, 18944)),
}
# name -> ("int", bits, group (0: per channel), zeros[, mins]) or ("fp8", block_n, block_k, act_group);
# int4-g32-mins and int8-g32 are GGUF's Q4_1 and Q8_0 (the default model's weights are Q4_1)
FORMATS = {
    "bf16": ("bf16",),
    "int4-g128": ("int", 4, 128, True),
    "int8-g128": ("int", 8, 128, False),
    "int8-channel": ("int", 8, 0, False),
    "int4-g32-mins": ("int", 4, 32, False, True),
    "int8-g32": ("int", 8, 32, False),
    "fp8-block-w8a16": ("fp8", 128, 128, -1),
    "fp8-block-w8a8": ("fp8", 128, 128, 128),
    "fp8-channel-w8a8": ("fp8", 1, 0, 0),
}


def make_call(fmt: str, n: int, k: int, m: int) -> tuple[Callable[..., torch.Tensor], list, int]:
    """(kernel, its arguments, bytes it reads and writes) for ``m`` rows of a random [n, k] weight."""
    from ingot.ops import reference as ref
    from ingot.ops.triton import fp8_linear, int_linear

    spec = FORMATS[fmt]
    x = torch.randn(m, k, dtype=BF16, device="cuda")
    io_bytes = 2 * m * (k + n)
    if spec[0] == "bf16":
        w = torch.randn(n, k, dtype=BF16, device="cuda") * k**-0.5
        return torch.nn.functional.linear, [x, w], 2 * n * k + io_bytes
    if spec[0] == "int":
        _, bits, group, zeros, *has_mins = spec
        group = group or k
        g = -(-k // group)
        qweight = ref.pack_int(torch.randint(0, 2**bits, (n, k), dtype=torch.int32, device="cuda"), bits)
        scales = torch.rand(n, g, dtype=torch.float16, device="cuda") / (2 ** (bits - 1) * k**0.5)
        zero_pts = torch.randint(0, 2**bits, (n, g), dtype=torch.uint8, device="cuda") if zeros else None
        mins = -scales * 2 ** (bits - 1) if has_mins else None  # Q4_1: d * u + m, zero point 0
        nbytes = n * k * bits // 8 + n * g * (2 + (1 if zeros else 0) + (2 if has_mins else 0)) + io_bytes
        zero_point = 0 if has_mins else 2 ** (bits - 1)
        return int_linear.int_linear, [x, qweight, scales, zero_pts, mins, None, bits, group, zero_point], nbytes
    _, block_n, block_k, act_group = spec
    weight = (torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    gn, gk = -(-n // (block_n or n)), -(-k // (block_k or k))
    weight_scale = torch.rand(gn, gk, device="cuda") / (64 * k**0.5)
    return fp8_linear.fp8_linear, [x, weight, weight_scale, None, block_n, block_k, act_group], n * k + 4 * gn * gk + io_bytes


def run_rows(args, copy_gbps: float) -> list:
    from benchmarks.kernel_timing import bench_flushed_graph

    rows = []
    print(f"{'shape':<5} {'proj':<8} {'N x K':>12} {'M':>4} {'format':<17} {'us':>9} {'GB/s':>7} {'%copy':>6} "
          f"{'TFLOP/s':>8} {'vs bf16':>8}")
    for shape, proj, m in itertools.product(args.shapes, SHAPES["7b"], args.batches):
        n, k = SHAPES[shape][proj]
        bf16_us = None
        for fmt in args.formats:
            fn, call, nbytes = make_call(fmt, n, k, m)
            us = 1e3 * bench_flushed_graph(lambda fn=fn, call=call: fn(*call))
            bf16_us = us if fmt == "bf16" else bf16_us
            gbps = nbytes / (us * 1e-6) / 1e9
            row = dict(shape=shape, proj=proj, n=n, k=k, m=m, format=fmt, us=us, bytes=nbytes, gbps=gbps,
                       pct_of_copy=100 * gbps / copy_gbps, tflops=2 * m * n * k / (us * 1e-6) / 1e12,
                       speedup_vs_bf16=None if bf16_us is None else bf16_us / us)
            rows.append(row)
            vs = f"{row['speedup_vs_bf16']:7.2f}x" if bf16_us is not None else "       -"
            print(f"{shape:<5} {proj:<8} {n:>6}x{k:<5} {m:>4} {fmt:<17} {us:9.2f} {gbps:7.0f} {row['pct_of_copy']:5.1f}% "
                  f"{row['tflops']:8.1f} {vs}")
            del fn, call
        torch.cuda.empty_cache()
    return rows


SWEEP_GEMV_1 = ([dict(use_dot=True, block_m=16, block_k=bk, block_n=bn, num_warps=w, waves=wv)
                 for (bn, w), bk, wv in itertools.product(((64, 4), (128, 4), (128, 8), (256, 8)), (64, 128), (2, 4, 8))]
                + [dict(use_dot=False, block_m=1, block_n=64, block_k=256, num_warps=4, waves=4)])  # the multiply-reduce
SWEEP_GEMV_16 = [dict(block_n=bn, num_warps=w, waves=wv, num_stages=st) for bn, w, wv, st in
                 itertools.product((64, 128, 256), (4, 8), (1, 2, 4), (3, 4))]
SWEEP_GEMM = [dict(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s) for bm, bn, bk, (w, s) in
              itertools.product((64, 128), (64, 128, 256), (64, 128), ((4, 3), (8, 3), (8, 4)))]
SWEPT = ("int4-g128", "int4-g32-mins", "int8-g32", "fp8-block-w8a16", "fp8-block-w8a8")


def run_sweep(formats: list, batches: list) -> list:
    """Each path's launch configurations at the 7B shapes; the best per (format, proj, batch)."""
    from benchmarks.kernel_timing import bench_flushed_graph
    from ingot.ops.triton import fp8_linear, int_linear

    out = []
    print("\n# sweep: us per configuration (flushed-graph timing); best per row")
    for fmt, proj, m in itertools.product([f for f in SWEPT if f in formats], SHAPES["7b"], batches):
        n, k = SHAPES["7b"][proj]
        fn, call, _ = make_call(fmt, n, k, m)
        table = (int_linear.launch_config(m, n, k, call[7], call[0].device, call[0].dtype, call[6]) if fn is int_linear.int_linear
                 else fp8_linear.launch_config(m, n, k, *call[4:7], call[0].device))
        grid = SWEEP_GEMV_1 if m == 1 else SWEEP_GEMV_16 if table.gemv else SWEEP_GEMM
        timings = []
        for fields in grid:
            cfg = replace(table, **fields)
            try:
                us = 1e3 * bench_flushed_graph(lambda cfg=cfg: fn(*call, config=cfg))
            except Exception as exc:  # noqa: BLE001 - a configuration that cannot compile or run is skipped
                print(f"  {fmt} {proj} M{m} {fields}: {type(exc).__name__}")
                continue
            timings.append(dict(format=fmt, proj=proj, m=m, config=fields, us=us))
        table_us = 1e3 * bench_flushed_graph(lambda: fn(*call))
        extra = ""
        if fn is int_linear.int_linear:  # the table's tiles unpacking by shifts and masks instead of prmt
            shifts_us = 1e3 * bench_flushed_graph(lambda: fn(*call, config=replace(table, prmt=False)))
            timings.append(dict(format=fmt, proj=proj, m=m, config="table, prmt=False", us=shifts_us))
            extra = f" (shifts {shifts_us:.2f})"
        best = min(timings, key=lambda t: t["us"], default=dict(us=float("nan"), config=None))
        print(f"  {fmt:<16} {proj:<8} M{m:<4} table {table_us:8.2f} us{extra} | best {best['us']:8.2f} us {best['config']}")
        out.extend(timings + [dict(format=fmt, proj=proj, m=m, config="table", us=table_us)])
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/quant-kernels-<date>.json)")
    parser.add_argument("--shapes", default="1.5b,7b", help="comma-separated, of: " + ", ".join(SHAPES))
    parser.add_argument("--batches", default="1,16,64,256", help="comma-separated row counts")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, of: " + ", ".join(FORMATS))
    parser.add_argument("--sweep", action="store_true", help="also sweep launch configurations (7B shapes)")
    args = parser.parse_args()
    args.shapes = args.shapes.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.formats = args.formats.split(",")
    unknown = [s for s in args.shapes if s not in SHAPES] + [f for f in args.formats if f not in FORMATS]
    if unknown:
        parser.error(f"unknown shapes or formats: {unknown}")
    if not torch.cuda.is_available():
        sys.exit("python -m benchmarks.quant_kernels needs a CUDA GPU")

    import triton

    from benchmarks.kernel_timing import copy_bandwidth, warm_gpu
    from ingot.ops.triton import register_cuda_kernels

    register_cuda_kernels()
    gpu = torch.cuda.get_device_name()
    print(f"# {gpu} | torch {torch.__version__} | triton {triton.__version__}")
    warm_gpu()
    copy_gbps = copy_bandwidth()
    print(f"# copy bandwidth {copy_gbps:,.0f} GB/s (read + write)\n")
    result = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                  date=dt.datetime.now().isoformat(timespec="seconds"), copy_gbps=copy_gbps, rows=run_rows(args, copy_gbps))
    if args.sweep:
        result["sweep"] = run_sweep(args.formats, args.batches)
    out = write_json(args.out or RESULTS / f"quant-kernels-{dt.date.today().isoformat()}.json", result)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
