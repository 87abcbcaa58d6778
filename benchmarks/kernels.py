"""Benchmark the Triton kernels against the GPU's ceilings and the PyTorch references.

    python -m benchmarks.kernels [--out PATH] [--no-ref] [--sweep [decode|skinny|skinny7b|elementwise|prefill|all]]

Ceilings (measured here, median of triton.testing.do_bench after warm-up, L2
flushed between runs): device-to-device copy bandwidth (bytes read + written)
and bf16 matmul TFLOP/s at 8192^3. Then each kernel with its default launch
configuration (each module's ``launch_config``): its achieved GB/s or TFLOP/s,
the % of the matching ceiling, the target, and the reference implementation's
time. Then the skinny GEMM per projection against cuBLAS, and what each fused
prologue costs. Writes JSON (default benchmarks/results/kernels-<date>.json)
with the GPU name, torch/triton versions and the date.

``--sweep`` also times each kernel over a grid of launch configurations, passed
to the kernel as its ``config`` argument, to retune a ``launch_config`` table:
decode attention (tiles, warps, stages, waves), the skinny GEMM (1.5B or 7B
projections), RMSNorm and rotary (``elementwise``), prefill attention.

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


def prefill_case(tokens, hq, hkv, d, page=16):
    k_cache, v_cache, table = paged_cache(1, tokens, hkv, d, page)
    q = torch.randn(tokens, hq, d, dtype=BF16, device=DEV)
    k = torch.randn(tokens, hkv, d, dtype=BF16, device=DEV)
    v = torch.randn(tokens, hkv, d, dtype=BF16, device=DEV)
    slots = (table[0].long()[:, None] * page + torch.arange(page, device=DEV)).view(-1)[:tokens]
    ref.store_kv(k, v, k_cache, v_cache, slots)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device=DEV)
    flops = 4 * tokens * tokens / 2 * hq * d
    return (q, k, v, k_cache, v_cache, cu, seq_lens, table, d**-0.5), flops


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

    from ingot.ops.triton import activation, decode_attention, kv_store, prefill_attention

    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()
    print(f"# {gpu} | torch {torch.__version__} | triton {triton.__version__}")
    warm_gpu()
    bw = copy_bandwidth()
    tf = matmul_tflops()
    print(f"# ceilings: copy {bw:,.0f} GB/s (read+write), bf16 matmul {tf:,.0f} TFLOP/s (8192^3)\n")

    rows = []
    pending = []  # (row, fn): re-timed at the end, so each row's repeats are apart in time

    def record(name, shape, fn, ref_fn, *, nbytes=None, flops=None, target=None):
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
        rows.append(row)
        pending.append((row, fn))
        ref_s = f"{ref_ms:9.3f}" if ref_ms is not None else "        -"
        tgt = f"{target:>3d}%" if target is not None else "   -"
        mark = "" if target is None else ("  ok" if pct >= target else "  BELOW")
        print(f"{name:<22} {shape:<30} {ms:9.4f} {rate:10.1f} {unit:<7} {pct:6.1f}% {tgt} {ref_s}{mark}"
              f"  (do_bench {ms_do_bench:.4f})")

    print(f"{'kernel':<22} {'shape':<30} {'ms':>9} {'rate':>10} {'':<7} {'%ceil':>7} {'tgt':>4} {'ref ms':>9}")

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

    # prefill attention: 4096-token causal, 28/4 heads, d128
    call, flops = prefill_case(4096, 28, 4, 128)
    record("prefill_attention", "T4096 causal 28/4 d128",
           lambda: prefill_attention.prefill_attention(*call),
           lambda: ref.prefill_attention(*call), flops=flops, target=35)
    print(f"# prefill config: {prefill_attention.launch_config(128, call[0].device)}")

    # torch SDPA (flash) on the same shape, for context (not a reference impl)
    q, k, v = call[0], call[1], call[2]
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    try:
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)  # noqa: E731
        record("torch sdpa (context)", "T4096 causal 28/4 d128", sdpa, None, flops=flops)
    except Exception as exc:  # older torch without enable_gqa
        print(f"# sdpa skipped: {exc}")

    # chunked prefill: 8 sequences of 512 new tokens after 1536 cached ones
    gen_q = [512] * 8
    call2, _ = _chunked_case(gen_q, [2048] * 8, 28, 4, 128)
    flops2 = sum(4 * n * (c - n) + 4 * n * n / 2 for n, c in zip(gen_q, [2048] * 8)) * 28 * 128
    record("prefill_attention", "8x(512 new | 2048 ctx) 28/4", lambda: prefill_attention.prefill_attention(*call2),
           lambda: ref.prefill_attention(*call2), flops=flops2)
    torch.cuda.empty_cache()

    _repeat(rows, pending)
    skinny = _skinny_rows()
    prologues = _prologue_rows()
    elementwise = _sweep_elementwise(bw) if args.sweep in ("elementwise", "all") else None
    sweep = _sweep_decode() if args.sweep in ("decode", "all") else None
    prefill_sweep = _sweep_prefill(tf) if args.sweep in ("prefill", "all") else None
    skinny_sweep = _sweep_skinny() if args.sweep in ("skinny", "all") else None
    if args.sweep in ("skinny7b", "all"):
        skinny_sweep = (skinny_sweep or []) + _sweep_skinny("7b")

    return dict(
        gpu=gpu, torch=torch.__version__, triton=triton.__version__,
        date=dt.datetime.now().isoformat(timespec="seconds"),
        ceilings=dict(copy_gbps=bw, matmul_bf16_tflops=tf),
        results=rows, decode_sweep=sweep, skinny_gemm=skinny, skinny_sweep=skinny_sweep,
        skinny_prologues=prologues, elementwise_sweep=elementwise, prefill_sweep=prefill_sweep,
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


def _chunked_case(q_lens, ctx_lens, hq, hkv, d, page=16):
    b = len(q_lens)
    blocks = max(-(-c // page) for c in ctx_lens)
    k_cache, v_cache, table = paged_cache(b, blocks * page, hkv, d, page)
    t = sum(q_lens)
    q = torch.randn(t, hq, d, dtype=BF16, device=DEV)
    k = torch.randn(t, hkv, d, dtype=BF16, device=DEV)
    v = torch.randn(t, hkv, d, dtype=BF16, device=DEV)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
    return (q, k, v, k_cache, v_cache, cu, seq_lens, table, d**-0.5), None


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


def _sweep_skinny(shape: str = "1.5b") -> list:
    """Tile configurations of the skinny GEMM on one shape's projections. 1.5B: M=1 (the
    multiply-reduce form against tl.dot) and M=16 (tl.dot only). 7B: M=1 multiply-reduce
    only, with wider and deeper tiles (its down projection ran faster with 32-wide tiles
    and the SiLU prologue than plain with the 16-wide default: kernels-2026-11-30-s5.json)."""
    from ingot.ops.triton import skinny_gemm

    print(f"\n# skinny GEMM sweep, {shape} (graph replay us): M form BLOCK_N BLOCK_K warps waves")
    names = ("qkv", "gate_up", "down") if shape == "1.5b" else ("qkv", "o", "gate_up", "down")
    cases = {name: PROJECTIONS[shape][name] for name in names}
    weights = {name: torch.randn(n, k, dtype=BF16, device=DEV) for name, (n, k) in cases.items()}
    out = []
    if shape == "1.5b":
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
        ok = [r for r in out if "error" not in r and r["m"] == m]
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


def _sweep_prefill(matmul_tflops: float) -> list:
    """Key tile widths, warps and stages of prefill attention (128-row query tiles): the
    candidates Triton's autotuner chose from, on a 4096-token causal prefill with 28/4
    heads at head dim 128 and 64."""
    from ingot.ops.triton import prefill_attention as mod

    print("\n# prefill sweep: head dim, BLOCK_N warps stages -> ms, % of bf16 matmul")
    out = []
    for d in (128, 64):
        call, flops = prefill_case(4096, 28, 4, d)
        default = mod.launch_config(d, call[0].device)
        for block_n, warps, stages in ((64, 8, 3), (64, 4, 3), (128, 8, 3), (64, 8, 4), (32, 4, 3)):
            cfg = mod.PrefillConfig(128, block_n, warps, stages)
            try:
                ms = time_row(lambda: mod.prefill_attention(*call, cfg))[0]
            except Exception as exc:  # out of shared memory, ...
                out.append(dict(head_dim=d, config=str(cfg), error=type(exc).__name__))
                continue
            pct = 100 * flops / (ms * 1e-3) / 1e12 / matmul_tflops
            out.append(dict(head_dim=d, config=str(cfg), default=cfg == default, ms=ms, pct_of_matmul=pct))
            print(f"  d{d:<4} {block_n:4d} {warps:2d} {stages:2d}  {ms:8.4f} ms {pct:6.1f}%{'  (default)' if cfg == default else ''}")
        ok = [r for r in out if "error" not in r and r["head_dim"] == d]
        if ok:
            print(f"# best prefill config at head dim {d}: {min(ok, key=lambda r: r['ms'])}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/kernels-<date>.json)")
    parser.add_argument("--no-ref", action="store_true", help="skip timing the PyTorch reference implementations")
    parser.add_argument("--sweep", nargs="?", const="all", choices=("decode", "skinny", "skinny7b", "elementwise", "prefill", "all"),
                        help="also sweep launch configurations of the decode kernel, the skinny GEMM (1.5B "
                             "or 7B projections), RMSNorm and rotary, prefill attention, or all")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("python -m benchmarks.kernels needs a CUDA GPU")
    result = run(args)
    out = write_json(args.out or RESULTS / f"kernels-{dt.date.today().isoformat()}.json", result)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
