"""Benchmark the Triton kernels against the GPU's ceilings and the PyTorch references.

    python -m benchmarks.kernels [--out PATH] [--no-ref] [--only prefill|skinny] [--sweep [decode|skinny|skinny7b|skinny-moe|elementwise|prefill|all]]

Ceilings (measured here, median of triton.testing.do_bench after warm-up, L2
flushed between runs): device-to-device copy bandwidth (bytes read + written)
and bf16 matmul TFLOP/s at 8192^3. Then each kernel with its default launch
configuration (each module's ``launch_config``): its achieved GB/s or TFLOP/s,
the % of the matching ceiling, the target, and the reference implementation's
time. Prefill attention: the op as dispatched, each of its paths (the fused
Triton kernel; PyTorch's flash or cuDNN attention plus the Triton context
kernel; a KV gather plus flash) and PyTorch's own attention on the same
shapes, with a verdict line per shape (``--only prefill``: only these). Then the
skinny GEMM per projection against cuBLAS, and what each fused prologue costs.
Writes JSON (default benchmarks/results/kernels-<date>.json) with the GPU name,
torch/triton versions and the date.

``--sweep`` also times each kernel over a grid of launch configurations, passed
to the kernel as its ``config`` argument, to retune a ``launch_config`` table:
decode attention (tiles, warps, stages, waves), the skinny GEMM (1.5B or 7B
projections; ``skinny-moe``: the attention projections and routers of the
Qwen3-30B-A3B and Mixtral-8x7B shapes), RMSNorm and rotary (``elementwise``), prefill attention (tiles of
the fused and context kernels, every path on a grid of shapes, and the launch
rule fitted to those timings).

The GPU is kept busy for a second before the ceilings (clocks ramp up). Kernel
rows are timed from CUDA graphs on a cold L2 (``bench_flushed_graph``: no host
in the loop) ``REPEATS`` times, the passes minutes apart, and the row is their
median; each row also keeps one do_bench figure (do_bench launches every call
from Python, so for a kernel shorter than the host's launch path it times the
host: on the shared H200 it read the 12/2 decode case at 31% of copy bandwidth
where graphs read 68%, ``kernels-2026-12-01.json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import torch

from benchmarks.kernel_timing import (
    BF16, DEV, bench, bench_graph_us, copy_bandwidth, host_us, matmul_tflops, time_row, warm_gpu,
)
from benchmarks.kernels_decode import decode_case, paged_cache, rope_decode_case, sweep_decode
from benchmarks.kernels_elementwise import elementwise_cases, sweep_elementwise
from benchmarks.kernels_prefill import prefill_rows, prefill_shape_verdicts
from benchmarks.kernels_prefill_sweep import sweep_prefill
from benchmarks.kernels_skinny import prologue_rows, skinny_rows, skinny_sweeps
from ingot.bench.report import write_json
from ingot.ops import reference as ref

RESULTS = Path(__file__).resolve().parent / "results"

REPEATS = 3


def run(args) -> dict:
    import triton

    from ingot.ops.triton import activation, decode_attention, kv_store

    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()
    print(f"# {gpu} | torch {torch.__version__} | triton {triton.__version__}")
    warm_gpu()
    bw = copy_bandwidth()
    tf = matmul_tflops()
    print(f"# ceilings: copy {bw:,.0f} GB/s (read+write), bf16 matmul {tf:,.0f} TFLOP/s (8192^3)\n")

    rows = []
    pending = []  # (row, fn): re-timed at the end, so each row's repeats are apart in time

    def record(name, shape, fn, ref_fn, *, nbytes=None, flops=None, target=None, host=False):
        ms_do_bench = bench(fn)  # the method of the earlier runs, for comparison
        ms, method = time_row(fn)
        ref_ms = None
        if ref_fn is not None and not args.no_ref:
            try:
                ref_ms = bench(ref_fn, rep_ms=100)
            except torch.OutOfMemoryError:
                ref_ms = None
            torch.cuda.empty_cache()
        if nbytes is not None:
            rate, unit, ceiling = nbytes / (ms * 1e-3) / 1e9, "GB/s", bw
        else:
            rate, unit, ceiling = flops / (ms * 1e-3) / 1e12, "TFLOP/s", tf
        pct = 100 * rate / ceiling
        row = dict(kernel=name, shape=shape, ms=ms, rate=rate, unit=unit, pct_of_ceiling=pct,
                   target_pct=target, meets_target=None if target is None else pct >= target,
                   ref_ms=ref_ms, speedup_vs_ref=None if ref_ms is None else ref_ms / ms,
                   ms_runs=[ms], method=method, ms_do_bench=ms_do_bench,
                   amount=nbytes if nbytes is not None else flops, ceiling=ceiling)
        if host:
            row["host_us"] = host_us(fn)
        rows.append(row)
        pending.append((row, fn))
        ref_s = f"{ref_ms:9.3f}" if ref_ms is not None else "        -"
        tgt = f"{target:>3d}%" if target is not None else "   -"
        mark = "" if target is None else ("  ok" if pct >= target else "  BELOW")
        host_s = f"  host {row['host_us']:.0f} us/call" if host else ""
        print(f"{name:<22} {shape:<30} {ms:9.4f} {rate:10.1f} {unit:<7} {pct:6.1f}% {tgt} {ref_s}{mark}"
              f"  (do_bench {ms_do_bench:.4f}){host_s}")
        return row

    print(f"{'kernel':<22} {'shape':<30} {'ms':>9} {'rate':>10} {'':<7} {'%ceil':>7} {'tgt':>4} {'ref ms':>9}")

    header = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                  date=dt.datetime.now().isoformat(timespec="seconds"), ceilings=dict(copy_gbps=bw, matmul_bf16_tflops=tf))
    if args.only == "skinny":
        return dict(header, skinny_gemm=skinny_rows(), skinny_sweep=skinny_sweeps(args.sweep))

    # prefill attention: each path of the op and PyTorch's attention on the same shapes
    prefill_groups = prefill_rows(record)
    if args.only == "prefill":
        _repeat(rows, pending)
        return dict(header, results=rows, prefill_verdicts=prefill_shape_verdicts(prefill_groups),
                    prefill_sweep=sweep_prefill(tf, prefill_groups) if args.sweep in ("prefill", "all") else None)

    # decode attention
    for hq, hkv in ((12, 2), (28, 4)):
        call, nbytes = decode_case(64, 2048, hq, hkv, 128)
        cfg = decode_attention.launch_config(128, 64 * hkv, call[0].device)
        splits = decode_attention.choose_num_splits(64, hkv, call[3].shape[1], 16, cfg.block_n, call[0].device, cfg.waves)
        record("decode_attention", f"B64 ctx2048 {hq}/{hkv} d128 S{splits}",
               lambda c=call: decode_attention.decode_attention(*c),
               lambda c=call: ref.decode_attention(*c), nbytes=nbytes, target=60)
        call, nbytes = rope_decode_case(64, 2048, hq, hkv, 128)
        record("decode_attention_rope", f"B64 ctx2048 {hq}/{hkv} d128 S{splits}",
               lambda c=call: decode_attention.decode_attention_rope(*c),
               lambda c=call: ref.decode_attention_rope(*c), nbytes=nbytes, target=60)
    for hq, hkv in ((12, 2), (28, 4)):
        call, _ = rope_decode_case(1, 512, hq, hkv, 128)
        us = bench_graph_us(lambda c=call: decode_attention.decode_attention_rope(*c))
        rows.append(dict(kernel="decode_attention_rope", shape=f"B1 ctx512 {hq}/{hkv} (graph)", us=us))
        print(f"{'decode_attention_rope':<22} {f'B1 ctx512 {hq}/{hkv} (graph)':<30} {us:8.2f} us per launch")
        # an engine's graphs hold block tables as wide as max_model_len (here 32K tokens): more,
        # mostly empty slices
        wide = torch.zeros(1, 2048, dtype=torch.int32, device=DEV)
        wide[:, : call[8].shape[1]] = call[8]
        call = call[:8] + (wide,) + call[9:]
        us = bench_graph_us(lambda c=call: decode_attention.decode_attention_rope(*c))
        rows.append(dict(kernel="decode_attention_rope", shape=f"B1 ctx512 {hq}/{hkv} table 32K (graph)", us=us))
        print(f"{'decode_attention_rope':<22} {f'B1 ctx512 {hq}/{hkv} table 32K (graph)':<30} {us:8.2f} us per launch")
    torch.cuda.empty_cache()

    # store_kv
    t, hkv, d = 4096, 4, 128
    k_cache, v_cache, table = paged_cache(1, t, hkv, d)
    k = torch.randn(t, hkv, d, dtype=BF16, device=DEV)
    v = torch.randn(t, hkv, d, dtype=BF16, device=DEV)
    slots = (table[0].long()[:, None] * 16 + torch.arange(16, device=DEV)).view(-1)[:t]
    record("store_kv", f"T{t} {hkv}x{d}", lambda: kv_store.store_kv(k, v, k_cache, v_cache, slots),
           lambda: ref.store_kv(k, v, k_cache, v_cache, slots), nbytes=4 * t * hkv * d * 2 + t * 8, target=70)

    # elementwise at 4096 tokens x hidden 3584
    t, h = 4096, 3584
    for case in elementwise_cases(t, h).values():
        record(case["kernel"], case["shape"], case["fn"], case["ref"], nbytes=case["nbytes"], target=70)

    for inter in (3584, 18944):
        g = torch.randn(t, 2 * inter, dtype=BF16, device=DEV)
        record("silu_and_mul", f"{t}x2*{inter}", lambda g=g: activation.silu_and_mul(g),
               lambda g=g: ref.silu_and_mul(g), nbytes=3 * t * inter * 2, target=70)
    torch.cuda.empty_cache()

    _repeat(rows, pending)
    prefill_verdicts = prefill_shape_verdicts(prefill_groups)
    skinny = skinny_rows()
    prologues = prologue_rows()
    elementwise = sweep_elementwise(bw) if args.sweep in ("elementwise", "all") else None
    sweep = sweep_decode() if args.sweep in ("decode", "all") else None
    prefill_sweep = sweep_prefill(tf, prefill_groups) if args.sweep in ("prefill", "all") else None
    skinny_sweep = skinny_sweeps(args.sweep)

    return dict(
        header, results=rows, decode_sweep=sweep, skinny_gemm=skinny, skinny_sweep=skinny_sweep,
        skinny_prologues=prologues, elementwise_sweep=elementwise, prefill_sweep=prefill_sweep,
        prefill_verdicts=prefill_verdicts,
    )


def _repeat(rows: list, pending: list) -> None:
    """Time every row ``REPEATS - 1`` more times (rows interleaved) and keep the median."""
    import statistics

    for _ in range(REPEATS - 1):
        for row, fn in pending:
            row["ms_runs"].append(time_row(fn)[0])
    print(f"\n# median of {REPEATS} runs per row (runs apart in time)")
    for row, _ in pending:
        ms = statistics.median(row["ms_runs"])
        scale = 1e9 if row["unit"] == "GB/s" else 1e12
        rate = row["amount"] / (ms * 1e-3) / scale
        pct = 100 * rate / row["ceiling"]
        target = row["target_pct"]
        row.update(ms=ms, rate=rate, pct_of_ceiling=pct, meets_target=None if target is None else pct >= target,
                   speedup_vs_ref=None if row["ref_ms"] is None else row["ref_ms"] / ms)
        runs = " ".join(f"{m:.4f}" for m in row["ms_runs"])
        mark = "" if target is None else ("  ok" if pct >= target else "  BELOW")
        print(f"{row['kernel']:<22} {row['shape']:<30} {ms:9.4f} {rate:10.1f} {row['unit']:<7} {pct:6.1f}%  [{runs}]{mark}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/kernels-<date>.json)")
    parser.add_argument("--no-ref", action="store_true", help="skip timing the PyTorch reference implementations")
    parser.add_argument("--only", choices=("prefill", "skinny"), default=None,
                        help="only the prefill rows or the skinny GEMM rows (and their sweep, if asked for)")
    parser.add_argument("--sweep", nargs="?", const="all", choices=("decode", "skinny", "skinny7b", "skinny-moe", "elementwise", "prefill", "all"),
                        help="also sweep launch configurations of the decode kernel, the skinny GEMM (1.5B, 7B "
                             "or MoE-shape projections), RMSNorm and rotary, prefill attention, or all")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("python -m benchmarks.kernels needs a CUDA GPU")
    result = run(args)
    out = write_json(args.out or RESULTS / f"kernels-{dt.date.today().isoformat()}.json", result)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
