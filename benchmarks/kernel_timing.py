"""Timing and ceilings shared by the kernel benchmarks (``benchmarks.kernels``, ``benchmarks.quant_kernels``).

A kernel row is timed from CUDA graphs on a cold L2 (``bench_flushed_graph``: no host in
the loop); do_bench (``bench``) launches every call from Python and so times the host for
kernels shorter than its launch path. The ceilings are the device-to-device copy
bandwidth and bf16 matmul throughput measured in the same run.
"""

from __future__ import annotations

import torch

BF16 = torch.bfloat16
DEV = "cuda"


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


def bench_graph_us(fn) -> float:
    """Median microseconds of ``fn`` replayed from a CUDA graph (launch-bound small cases)."""
    from triton.testing import do_bench_cudagraph

    return 1e3 * float(do_bench_cudagraph(fn, rep=50, return_mode="median"))


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
