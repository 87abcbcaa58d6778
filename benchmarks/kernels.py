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
import itertools
import sys
from pathlib import Path
from typing import Optional

import torch

from ingot.bench.report import write_json
from ingot.ops import reference as ref

RESULTS = Path(__file__).resolve().parent / "results"
BF16 = torch.bfloat16
DEV = "cuda"


REPEATS = 3


def warm_gpu(seconds: float = 1.0) -> None:
    """Busy the GPU so its clocks are up before the first measurement."""
    import time

    a = torch.randn(4096, 4096, dtype=BF16, device=DEV)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def bench(fn, rep_ms: int = 200) -> float:
    """Median milliseconds of ``fn`` (after warm-up; L2 flushed between runs)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=50, rep=rep_ms, return_mode="median"))


FLUSH_BYTES = 256 << 20  # several times the H200's L2


def bench_flushed_graph(fn, reps: int = 10, repeats: int = 7) -> float:
    """Median milliseconds of one call of ``fn`` on a cold L2 with no host in the loop.

    A CUDA graph of ``reps`` (L2 flush, ``fn``) pairs is timed against a graph of
    the flushes alone, interleaved ``repeats`` times; the difference per call is
    the kernel's time. do_bench instead launches every call from Python, so a
    kernel shorter than the host's launch path is timed by the host: on the shared
    H200 the 20-100 us kernels read up to 2x slower in some passes than in others.
    """
    import statistics

    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=DEV)
    fn()  # compile and allocate (split counters) before the capture
    torch.cuda.synchronize()

    def capture(body) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                body()
        return graph

    def flush_and_call():
        flush.zero_()
        fn()

    with_fn, flush_only = capture(flush_and_call), capture(flush.zero_)

    def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    diffs = [(replay_ms(with_fn) - replay_ms(flush_only)) / reps for _ in range(repeats)]
    return statistics.median(diffs)


def time_row(fn) -> tuple[float, str]:
    """(ms, method): ``bench_flushed_graph``, or do_bench for what cannot be captured."""
    try:
        return bench_flushed_graph(fn), "graph"
    except Exception as exc:  # noqa: BLE001 - a benchmark row must not end the run
        print(f"# graph timing failed ({type(exc).__name__}: {exc}); do_bench instead")
        torch.cuda.synchronize()
        return bench(fn), "do_bench"


# ----------------------------------------------------------------------------- ceilings
def copy_bandwidth() -> float:
    n = 1 << 30  # bytes per buffer
    src = torch.empty(n // 2, dtype=BF16, device=DEV).normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3) / 1e9  # GB/s, read + write


def matmul_tflops() -> float:
    n = 8192
    a = torch.randn(n, n, dtype=BF16, device=DEV)
    b = torch.randn(n, n, dtype=BF16, device=DEV)
    ms = bench(lambda: torch.matmul(a, b))
    return 2 * n**3 / (ms * 1e-3) / 1e12


# ----------------------------------------------------------------------------- cases
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
        return dict(header, skinny_gemm=_skinny_rows(), skinny_sweep=_skinny_sweeps(args.sweep))

    # prefill attention: each path of the op and PyTorch's attention on the same shapes
    prefill_groups = _prefill_rows(record)
    if args.only == "prefill":
        _repeat(rows, pending)
        return dict(header, results=rows, prefill_verdicts=_prefill_verdicts(prefill_groups),
                    prefill_sweep=_sweep_prefill(tf, prefill_groups) if args.sweep in ("prefill", "all") else None)

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
    prefill_verdicts = _prefill_verdicts(prefill_groups)
    skinny = _skinny_rows()
    prologues = _prologue_rows()
    elementwise = _sweep_elementwise(bw) if args.sweep in ("elementwise", "all") else None
    sweep = _sweep_decode() if args.sweep in ("decode", "all") else None
    prefill_sweep = _sweep_prefill(tf, prefill_groups) if args.sweep in ("prefill", "all") else None
    skinny_sweep = _skinny_sweeps(args.sweep)

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


def rope_decode_case(batch, ctx, hq, hkv, d):
    """Arguments of decode_attention_rope: ``ctx`` tokens per sequence, the last one new."""
    (q, k_cache, v_cache, table, seq_lens, scale), nbytes = decode_case(batch, ctx, hq, hkv, d)
    k = torch.randn(batch, hkv, d, dtype=BF16, device=DEV)
    v = torch.randn(batch, hkv, d, dtype=BF16, device=DEV)
    positions = seq_lens.long() - 1
    slots = table.gather(1, (positions // 16)[:, None]).long().squeeze(1) * 16 + positions % 16
    cos_sin = torch.randn(ctx, d, device=DEV)
    return (q, k, v, positions, cos_sin, k_cache, v_cache, slots, table, seq_lens, scale), nbytes


def bench_graph_us(fn) -> float:
    """Median microseconds of ``fn`` replayed from a CUDA graph (launch-bound small cases)."""
    from triton.testing import do_bench_cudagraph

    return 1e3 * float(do_bench_cudagraph(fn, rep=50, return_mode="median"))


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


def _skinny_rows() -> list:
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


def _prologue_rows() -> list:
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


def _sweep_elementwise(copy_gbps: float, t: int = 4096, h: int = 3584) -> list:
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


def _skinny_sweeps(sweep: Optional[str]) -> Optional[list]:
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
                res[name] = bench_graph_us(lambda x=x, w=w: skinny_gemm.skinny_linear(x, w, None, cfg))
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


def _sweep_decode() -> list:
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


# ----------------------------------------------------------------------------- prefill
PREFILL_PATHS = ("triton", "flash", "cudnn", "gather")  # ingot/ops/triton/prefill_dispatch.py
# tiles of the fused and the context kernel that --sweep prefill times, by head dim: (query tile,
# key tile, warps, stages, key tile over the cached prefix, stages of the cached-prefix loop; None:
# as the new tokens'). That loop's block-id load takes a stage: at 3 stages one K/V tile is in flight
# there, at 5 two (as in the new-token loops at 3). All fit the H200's 227 KiB of shared memory
# (compiled for sm90): 128-row tiles one program per SM, 64 x 64 at 4 warps two.
PREFILL_SWEEP = {
    128: [(128, 128, 8, 3, None, None), (128, 64, 8, 3, None, None), (128, 128, 8, 2, None, None),
          (128, 128, 8, 3, None, 5), (128, 128, 8, 3, 64, 5), (128, 64, 8, 3, 128, 5), (128, 64, 8, 3, None, 5),
          (64, 64, 4, 3, None, None), (64, 64, 4, 3, None, 5)],
    64: [(128, 64, 4, 3, None, None), (128, 64, 4, 3, None, 5), (128, 128, 8, 3, None, None), (128, 128, 8, 3, None, 5)],
}
# the kernel rows' shapes (q_lens, ctx_lens, Hq, Hkv, D): one 4096-token prompt; 8 chunks of 512
# new tokens after 1536 cached ones; 8 prompts of 512
PREFILL_SHAPES = {
    "T4096 causal 28/4 d128": ([4096], [4096], 28, 4, 128),
    "8x(512 new | 2048 ctx) 28/4": ([512] * 8, [2048] * 8, 28, 4, 128),
    "8x512 causal 28/4 d128": ([512] * 8, [512] * 8, 28, 4, 128),
}
# the launch rule's measurements (q_lens, ctx_lens), head dim 128, at both head counts below
PREFILL_GRID = [
    # no cached prefix; prompts of a multiple of the 16-token block fill their table rows, which
    # tells the op that nothing is cached (no context kernel, no log-sum-exp), the others do not
    ([256], [256]), ([1000], [1000]), ([4096], [4096]), ([4001], [4001]), ([8192], [8192]),
    ([1000] * 4, [1000] * 4), ([512] * 8, [512] * 8), ([500] * 8, [500] * 8), ([128] * 32, [128] * 32),
    ([30] * 128, [30] * 128),
    # after a cached prefix (chunked prefill, prefix cache)
    ([512], [4096]), ([2048], [8192]), ([64], [2048]),
    ([512] * 8, [2048] * 8), ([128] * 32, [1024] * 32), ([16] * 64, [1024] * 64),
    # both in one batch
    ([700, 300, 2000, 50], [700, 1300, 2000, 1050]),
]
PREFILL_GRID_HEADS = ((28, 4), (12, 2))  # the 7B and the 1.5B shapes
RULE_THRESHOLDS = (0, 32, 64, 128, 256, 512, 1024, 2048)  # mean new tokens per sequence


def prefill_call(q_lens, ctx_lens, hq, hkv, d, page=16):
    """(the op's arguments, FLOPs): sequence ``b`` holds ``ctx_lens[b]`` tokens, its last
    ``q_lens[b]`` new (random K/V, also stored in the cache where the model stores them)."""
    batch = len(q_lens)
    k_cache, v_cache, table = paged_cache(batch, max(ctx_lens), hkv, d, page)
    t = sum(q_lens)
    q = torch.randn(t, hq, d, dtype=BF16, device=DEV)
    k = torch.randn(t, hkv, d, dtype=BF16, device=DEV)
    v = torch.randn(t, hkv, d, dtype=BF16, device=DEV)
    pos = torch.cat([torch.arange(c - n, c) for n, c in zip(q_lens, ctx_lens)]).to(DEV)
    seq = torch.repeat_interleave(torch.arange(batch), torch.tensor(q_lens)).to(DEV)
    ref.store_kv(k, v, k_cache, v_cache, table[seq, pos // page].long() * page + pos % page)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
    flops = sum(4 * n * (c - n) + 2 * n * n for n, c in zip(q_lens, ctx_lens)) * hq * d
    return (q, k, v, k_cache, v_cache, cu, seq_lens, table, d**-0.5), flops


def _prefill_shape_args(call) -> tuple:
    """(tokens, sequences, capacity, Hq, Hkv, D, dtype, device): what the launch rule sees."""
    q, k, k_cache, table = call[0], call[1], call[3], call[7]
    return q.shape[0], table.shape[0], table.shape[1] * k_cache.shape[1], q.shape[1], k.shape[1], q.shape[2], q.dtype, q.device


def host_us(fn, calls: int = 20) -> float:
    """Host microseconds per call of ``fn`` (launching only, the GPU runs behind): what a path
    costs the engine's thread, which graph timing does not see."""
    import time

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def _try_record(record, name, shape, fn, flops):
    """``record`` a row (with host time) unless ``fn`` fails, as for a backend this torch or
    GPU lacks: None then."""
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a missing backend must not end the run
        print(f"# {name} skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
        return None
    return record(name, shape, fn, None, flops=flops, host=True)


def _prefill_rows(record) -> list:
    """Per PREFILL_SHAPES shape: the op as dispatched (``prefill_attention``), each path it can
    take (``prefill [path]``), and PyTorch's attention on the same shape."""
    from ingot.ops.triton import prefill_attention as kernels
    from ingot.ops.triton import prefill_dispatch as pd

    groups = []
    for label, (q_lens, ctx_lens, hq, hkv, d) in PREFILL_SHAPES.items():
        call, flops = prefill_call(q_lens, ctx_lens, hq, hkv, d)
        shape_args = _prefill_shape_args(call)
        chosen = pd.choose_prefill_path(*shape_args)
        print(f"# {label}: the op runs [{chosen}] (PREFILL_RULES[{pd.prefill_class(*shape_args[:3])}]); "
              f"fused kernel tiles {kernels.launch_config(d, call[0].device)}")
        op = record("prefill_attention", label, lambda c=call: pd.prefill_attention(*c),
                    lambda c=call: ref.prefill_attention(*c), flops=flops, target=35 if len(q_lens) == 1 else None, host=True)
        paths = {}
        for path in PREFILL_PATHS:
            if not pd.path_supported(path, *shape_args):
                print(f"# prefill [{path}] cannot run {label} here (prefill_dispatch.path_supported)")
                continue
            row = _try_record(record, f"prefill [{path}]", label, lambda c=call, p=path: pd.prefill_attention(*c, path=p), flops)
            if row is not None:
                paths[path] = row
        groups.append(dict(shape=label, chosen=chosen, op=op, paths=paths, **_sdpa_rows(record, label, call, q_lens, ctx_lens, flops)))
        del call
        torch.cuda.empty_cache()
    return groups


def _sdpa_backend(q, k, v, scale) -> str:
    """The backend ``scaled_dot_product_attention`` picks for these causal GQA inputs."""
    try:
        from torch.nn.attention import SDPBackend

        return SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=True, scale=scale, enable_gqa=True)).name
    except Exception as exc:  # noqa: BLE001 - informative only
        return f"unknown ({type(exc).__name__})"


def _sdpa_rows(record, label, call, q_lens, ctx_lens, flops) -> dict:
    """PyTorch's attention on a PREFILL_SHAPES shape (equal lengths). Without a cached prefix:
    ``scaled_dot_product_attention`` on ``[B, H, n, D]`` views of the packed tokens with the
    backend PyTorch picks (``torch sdpa (context)``, the row the verdict compares against),
    then each backend forced. With a cached
    prefix: SDPA over contiguous K/V with a lower-right causal mask (``causal_lower_right``,
    the row compared against), and flash's varlen forward over the same contiguous K/V."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa_fn = torch.nn.functional.scaled_dot_product_attention
    q, k, v, cu, scale = call[0], call[1], call[2], call[5], call[8]
    batch, n, hq, hkv, d = len(q_lens), q_lens[0], q.shape[1], k.shape[1], q.shape[2]
    assert len(set(q_lens)) == 1 and len(set(ctx_lens)) == 1, "the SDPA rows take equal lengths"
    if q_lens == ctx_lens:
        qd, kd, vd = (t.view(batch, n, t.shape[1], d).transpose(1, 2) for t in (q, k, v))

        def sdpa():
            return sdpa_fn(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)

        print(f"# torch sdpa picks {_sdpa_backend(qd, kd, vd, scale)} for {label}")
        compare = _try_record(record, "torch sdpa (context)", label, sdpa, flops)
        for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
            def forced(b=getattr(SDPBackend, backend)):
                with sdpa_kernel(b):
                    return sdpa()

            _try_record(record, f"torch sdpa [{backend.split('_')[0].lower()}]", label, forced, flops)
        return dict(compare=compare)
    from torch.nn.attention.bias import causal_lower_right

    ctx = ctx_lens[0]
    qd = torch.randn(batch, hq, n, d, dtype=BF16, device=DEV)
    kd = torch.randn(batch, hkv, ctx, d, dtype=BF16, device=DEV)
    vd = torch.randn(batch, hkv, ctx, d, dtype=BF16, device=DEV)
    bias = causal_lower_right(n, ctx)

    def lower_right():
        return sdpa_fn(qd, kd, vd, attn_mask=bias, scale=scale, enable_gqa=True)

    compare = _try_record(record, "torch sdpa lower-right", label, lower_right, flops)
    if compare is None:  # a torch whose CausalBias dispatch takes no enable_gqa
        ke, ve = kd.repeat_interleave(hq // hkv, 1), vd.repeat_interleave(hq // hkv, 1)
        compare = _try_record(record, "torch sdpa lower-right (K/V repeated)", label,
                              lambda: sdpa_fn(qd, ke, ve, attn_mask=bias, scale=scale), flops)
    kp, vp = (t.transpose(1, 2).reshape(batch * ctx, hkv, d) for t in (kd, vd))
    cu_k = torch.arange(0, (batch + 1) * ctx, ctx, dtype=torch.int32, device=DEV)

    def flash_varlen():
        return torch.ops.aten._flash_attention_forward(q, kp, vp, cu, cu_k, n, ctx, 0.0, True, False, scale=scale)

    _try_record(record, "torch flash varlen", label, flash_varlen, flops)
    return dict(compare=compare)


def run_spread(row: dict) -> float:
    """The spread of a row's passes, (slowest - fastest) / median: how far apart two timings of
    one kernel fall on this GPU, so a difference inside it is no difference."""
    runs = row.get("ms_runs") or [row["ms"]]
    return (max(runs) - min(runs)) / row["ms"]


def _prefill_verdicts(groups: list) -> list:
    """One line per PREFILL_SHAPES shape, on the rows' median times: what the op runs and the
    fastest path, each against PyTorch's row ('at or above' = no slower; 'tie' = slower by less
    than the PyTorch row's own spread between passes, as when both run the same kernel)."""
    print("\n# prefill verdicts (medians; 'AT OR ABOVE' = no slower than the PyTorch row of the same shape, "
          "'TIE' = slower within that row's own spread between passes)")
    out = []
    for g in groups:
        op, sdpa = g["op"], g["compare"]
        best_path, best = min(g["paths"].items(), key=lambda kv: kv[1]["ms"]) if g["paths"] else (g["chosen"], op)
        if sdpa is None:
            print(f"# verdict {g['shape']}: no PyTorch row ran; the op [{g['chosen']}] {op['ms']:.4f} ms, "
                  f"fastest path [{best_path}] {best['ms']:.4f} ms")
            out.append(dict(shape=g["shape"], op_path=g["chosen"], op_ms=op["ms"], best_path=best_path, best_ms=best["ms"]))
            continue

        spread = run_spread(sdpa)

        def state(row):
            word = "AT OR ABOVE" if row["ms"] <= sdpa["ms"] else "TIE" if row["ms"] <= sdpa["ms"] * (1 + spread) else "BELOW"
            return f"{word} ({sdpa['ms'] / row['ms']:.3f}x)"

        print(f"# verdict {g['shape']}: the op [{g['chosen']}] {op['ms']:.4f} ms ({op['pct_of_ceiling']:.1f}% of matmul) "
              f"{state(op)} {sdpa['kernel']} {sdpa['ms']:.4f} ms ({sdpa['pct_of_ceiling']:.1f}%); "
              f"fastest path [{best_path}] {best['ms']:.4f} ms {state(best)}")
        out.append(dict(shape=g["shape"], op_path=g["chosen"], op_ms=op["ms"], sdpa_row=sdpa["kernel"], sdpa_ms=sdpa["ms"],
                        best_path=best_path, best_ms=best["ms"], op_at_or_above=op["ms"] <= sdpa["ms"],
                        best_at_or_above=best["ms"] <= sdpa["ms"], sdpa_spread=spread,
                        op_within_spread=op["ms"] <= sdpa["ms"] * (1 + spread)))
    return out


def _sweep_prefill(matmul_tflops: float, groups: list) -> dict:
    tiles = _sweep_prefill_tiles(matmul_tflops)
    best = _prefill_best_verdicts(groups, tiles)
    return dict(tiles=tiles, verdicts_best_tiles=best, **_sweep_prefill_paths())


def _sweep_prefill_tiles(matmul_tflops: float) -> list:
    """PREFILL_SWEEP's tiles in the fused kernel (the PREFILL_SHAPES shapes, and the 4096-token
    prompt at head dim 64) and in the context kernel (the chunked shape, through the flash path)."""
    from ingot.ops.triton import prefill_attention as kernels
    from ingot.ops.triton import prefill_dispatch as pd

    print("\n# prefill tile sweep: case, kernel, BLOCK_M BLOCK_N warps stages BLOCK_N_CTX CTX_STAGES -> ms, % of bf16 matmul")
    cases = [(label, shape, ("triton", "flash") if shape[0] != shape[1] else ("triton",)) for label, shape in PREFILL_SHAPES.items()]
    cases.append(("T4096 causal 28/4 d64", ([4096], [4096], 28, 4, 64), ("triton",)))
    out = []
    for label, shape, paths in cases:
        call, flops = prefill_call(*shape)
        default = kernels.launch_config(shape[4], call[0].device)
        for path in paths:
            if not pd.path_supported(path, *_prefill_shape_args(call)):
                continue
            kernel = "fused" if path == "triton" else "context"
            for tiles in PREFILL_SWEEP[shape[4]]:
                cfg = kernels.PrefillConfig(*tiles)
                head = f"  {label:<28} {kernel:<8} " + " ".join(f"{t!s:>4}" for t in tiles)
                try:
                    ms = time_row(lambda c=call, p=path, k=cfg: pd.prefill_attention(*c, path=p, config=k))[0]
                except Exception as exc:  # out of shared memory, ...
                    out.append(dict(case=label, kernel=kernel, path=path, config=str(cfg), error=type(exc).__name__))
                    print(f"{head}  {type(exc).__name__}")
                    continue
                pct = 100 * flops / (ms * 1e-3) / 1e12 / matmul_tflops
                out.append(dict(case=label, kernel=kernel, path=path, config=str(cfg), default=cfg == default, ms=ms,
                                pct_of_matmul=pct))
                print(f"{head}  {ms:8.4f} ms {pct:6.1f}%{'  (default)' if cfg == default else ''}")
            ok = [r for r in out if "error" not in r and r["case"] == label and r["kernel"] == kernel]
            if ok:
                print(f"# best {kernel} tiles on {label}: {min(ok, key=lambda r: r['ms'])}")
        del call
        torch.cuda.empty_cache()
    return out


def _prefill_best_verdicts(groups: list, tiles: list) -> list:
    """The verdicts again with the tile sweep's timings counted in: per shape the fastest of the
    paths' rows and the swept tiles (one timing each, not a median of three), against the same
    PyTorch row."""
    print("\n# prefill verdicts with the swept tiles ('AT OR ABOVE' = no slower than the PyTorch row)")
    out = []
    for g in groups:
        sdpa = g["compare"]
        options = [(f"[{p}] default tiles", r["ms"]) for p, r in g["paths"].items()]
        options += [(f"[{t['path']}] {t['config']}", t["ms"]) for t in tiles if t["case"] == g["shape"] and "ms" in t]
        if sdpa is None or not options:
            continue
        how, ms = min(options, key=lambda o: o[1])
        state = "AT OR ABOVE" if ms <= sdpa["ms"] else "BELOW"
        print(f"# verdict {g['shape']}: fastest {how} {ms:.4f} ms {state} ({sdpa['ms'] / ms:.3f}x) {sdpa['kernel']} {sdpa['ms']:.4f} ms")
        out.append(dict(shape=g["shape"], fastest=how, ms=ms, sdpa_row=sdpa["kernel"], sdpa_ms=sdpa["ms"], at_or_above=ms <= sdpa["ms"]))
    return out


def _lens_label(q_lens, ctx_lens) -> str:
    if len(set(q_lens)) == 1 and len(set(ctx_lens)) == 1:
        return f"{len(q_lens)}x({q_lens[0]} | {ctx_lens[0]})"
    return "mixed " + " ".join(f"{n}|{c}" for n, c in zip(q_lens, ctx_lens))


def _sweep_prefill_paths() -> dict:
    """Every path of the op on PREFILL_GRID at PREFILL_GRID_HEADS (head dim 128): GPU ms from
    graphs and host us per call; then the launch rule fitted to them, printed as the
    ``PREFILL_RULES`` table to paste into prefill_dispatch.py."""
    from ingot.ops.triton import prefill_dispatch as pd

    print("\n# prefill paths: heads, sequences x (new | total tokens), class (one seq, mostly new) -> "
          "ms per path (host us per call); fastest")
    entries = []
    for hq, hkv in PREFILL_GRID_HEADS:
        for q_lens, ctx_lens in PREFILL_GRID:
            call, _ = prefill_call(q_lens, ctx_lens, hq, hkv, 128)
            args = _prefill_shape_args(call)
            entry = dict(heads=f"{hq}/{hkv}", shape=_lens_label(q_lens, ctx_lens), tokens=args[0], seqs=args[1],
                         capacity=args[2], cls=list(pd.prefill_class(*args[:3])), times={}, host_us={})
            for path in PREFILL_PATHS:
                if not pd.path_supported(path, *args):
                    continue
                fn = lambda c=call, p=path: pd.prefill_attention(*c, path=p)  # noqa: E731
                try:
                    entry["times"][path] = time_row(fn)[0]
                    entry["host_us"][path] = host_us(fn)
                except Exception as exc:  # noqa: BLE001 - one failing path must not end the sweep
                    print(f"  {path} failed on {entry['shape']}: {type(exc).__name__}: {exc}")
            entries.append(entry)
            fastest = min(entry["times"], key=entry["times"].get) if entry["times"] else "-"
            cells = "  ".join(f"{p} {ms:.4f} ({entry['host_us'][p]:.0f})" for p, ms in entry["times"].items())
            print(f"  {entry['heads']:<5} {entry['shape']:<34} {str(tuple(entry['cls'])):<14} {cells}  -> {fastest}")
            del call
            torch.cuda.empty_cache()
    fitted = fit_prefill_rules(entries)
    print("\n# launch rule fitted to these timings (paste into ingot/ops/triton/prefill_dispatch.py); per class:")
    print("# shapes measured, sum over them of (time / fused-kernel time), the fused kernel's own sum")
    print("PREFILL_RULES: dict[tuple[bool, bool], PathRule] = {")
    for cls, f in fitted.items():
        cost = "no shapes" if f["cost"] is None else f"{f['shapes']} shapes: {f['cost']:.2f} vs {f['shapes']:.0f}"
        print(f"    {cls}: PathRule({f['path']!r}, min_tokens_per_seq={f['min_tokens_per_seq']}),  # {cost}")
    print("}")
    return dict(path_grid=entries, fitted_rules={str(cls): f for cls, f in fitted.items()},
                cudnn_new_length=_cudnn_new_length_cost(), cudnn_varlen=_cudnn_varlen_probe())


def fit_prefill_rules(entries: list, thresholds=RULE_THRESHOLDS) -> dict:
    """Per class of ``PREFILL_RULES``: the (path, min tokens per sequence) minimizing the sum,
    over the class's measured shapes, of each shape's time relative to the fused kernel (every
    shape weighs the same). A shape's time on a path is the larger of its GPU time and its host
    time per call (a launch slower than its kernel starves the GPU); a shape below the
    threshold, or that the path cannot run, counts the fused kernel's time, as
    ``choose_prefill_path`` falls back. Ties keep the fused kernel, then the higher threshold
    (a path is chosen only where it was measured to win)."""
    fitted = {}
    for cls in ((True, True), (True, False), (False, True), (False, False)):
        members = [e for e in entries if tuple(e["cls"]) == cls and "triton" in e["times"]]
        if not members:
            fitted[cls] = dict(path="triton", min_tokens_per_seq=0, cost=None, shapes=0)
            continue

        def time_of(e, path):
            return max(e["times"][path], e["host_us"].get(path, 0.0) / 1e3)

        def cost(path, threshold):
            total = 0.0
            for e in members:
                use = path if path in e["times"] and e["tokens"] >= threshold * e["seqs"] else "triton"
                total += time_of(e, use) / time_of(e, "triton")
            return total

        best = ("triton", 0, cost("triton", 0))
        for path in PREFILL_PATHS[1:]:
            for threshold in sorted(thresholds, reverse=True):
                c = cost(path, threshold)
                if c < best[2] - 1e-9:
                    best = (path, threshold, c)
        fitted[cls] = dict(path=best[0], min_tokens_per_seq=best[1], cost=best[2], shapes=len(members))
    return fitted


def _cudnn_varlen_probe():
    """PyTorch's cuDNN varlen forward (``aten._cudnn_attention_forward`` with offsets, what
    ``torch.nn.attention.varlen`` and nested tensors run) on 8 packed 512-token prompts,
    28/4 heads: do_bench ms (host in the loop; PyTorch 2.13's source builds its cuDNN
    plan on every such call, so no graph is captured) and host us per call, against the
    flash path of the op on the same tokens."""
    from ingot.ops.triton import prefill_dispatch as pd

    call, _ = prefill_call([512] * 8, [512] * 8, 28, 4, 128)
    q, k, v, cu, scale = call[0].contiguous(), call[1].contiguous(), call[2].contiguous(), call[5], call[8]

    def cudnn_varlen():
        return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, 512, 512, False, 0.0, True, False, scale=scale)

    try:
        cudnn_varlen()
        torch.cuda.synchronize()
        res = dict(do_bench_ms=bench(cudnn_varlen), host_us=host_us(cudnn_varlen))
    except Exception as exc:  # noqa: BLE001 - informative only
        print(f"# cuDNN varlen (8x512, 28/4): {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
        return None
    if pd.path_supported("flash", *_prefill_shape_args(call)):
        res["flash_path_do_bench_ms"] = bench(lambda: pd.prefill_attention(*call, path="flash"))
    print(f"# cuDNN varlen (8x512, 28/4): {res}")
    return res


def _cudnn_new_length_cost():
    """Host + GPU ms of the cuDNN path's first call at a prompt length it has not seen
    (PyTorch builds and caches one cuDNN execution plan per shape) and of the next call."""
    import time

    from ingot.ops.triton import prefill_dispatch as pd

    call, _ = prefill_call([3001], [3001], 12, 2, 128)
    if not pd.path_supported("cudnn", *_prefill_shape_args(call)):
        return None

    def once() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        pd.prefill_attention(*call, path="cudnn")
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    first, again = once(), once()
    print(f"# cuDNN path at a length it has not seen (T3001, 12/2): first call {first:.1f} ms, next {again:.2f} ms")
    return dict(first_ms=first, again_ms=again)


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
