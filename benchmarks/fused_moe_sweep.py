"""Time the fused_moe kernel's launch candidates per (architecture, batch), against the bytes it must read.

    python benchmarks/fused_moe_sweep.py [--shapes qwen3-30b-a3b,...] [--batches 1,2,4,...] [--out PATH]

For each architecture's expert shape and batch size: random uniform top-k routing,
``LAYERS`` layers of distinct expert weights (so, as in a decode step, one call's
experts are not in L2 from the previous call), every call captured in one CUDA
graph and replayed; ms per call is the graph's time over the layers. Each launch
candidate (the per-pair path; the grouped path over a grid of BLOCK_M / BLOCK_N /
BLOCK_K / warps / stages) is timed, and the table's own choice (``launch_config``)
is marked. ``floor`` is the bytes of the experts the routing hits, read once at the
measured copy bandwidth. The best candidate per row is what
``ingot/ops/triton/fused_moe.py``'s ``_TABLE`` should hold for this GPU.
Writes JSON (default benchmarks/results/fused_moe_sweep-<date>.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import itertools
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ingot.bench.report import env_info, write_json  # noqa: E402
from ingot.ops.triton import fused_moe as moe  # noqa: E402
from ingot.ops.triton.pdl import pdl_supported  # noqa: E402

# name -> (experts, top_k, hidden, expert width)
SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "qwen1.5-moe-a2.7b": (60, 4, 2048, 1408),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "olmoe-1b-7b": (64, 8, 2048, 1024),
}
LAYERS_BYTES = 4 << 30  # distinct expert weights per shape (>> L2), in as many layers as fit


def candidates(batch: int, pdl: bool) -> list[moe.MoeLaunch]:
    """Up to batch 32 the per-pair path: its gate/up tiles varied with the down tiles at the
    default, then the down tiles with gate/up at the default (the two launches are
    independent, so the best of each combine); at every batch the grouped path in 24.
    ``pdl``: the per-pair launches use programmatic dependent launch, as ``launch_config``
    gives them where it is supported (so the table's own choice is among the candidates)."""
    out = []
    if batch <= 32:
        base = dataclasses.replace(moe.PER_PAIR, pdl=pdl)
        tiles = [(bn, bk, warps, 4) for bn, bk, warps in itertools.product((8, 16, 32, 64), (128, 256, 512), (2, 4, 8))]
        out += [base] + [moe.MoeLaunch(False, 1, t, base.down, pdl=pdl) for t in tiles if t != base.gate_up]
        out += [moe.MoeLaunch(False, 1, base.gate_up, t, pdl=pdl) for t in tiles if t != base.down]
    for bm, bn, bk, warps in itertools.product((16, 32, 64), (64, 128), (64, 128), (4, 8)):
        out.append(moe.MoeLaunch(True, bm, (bn, bk, warps, 3), (bn, bk, warps, 3)))
    return out


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * src.numel() / (statistics.median(times) / 1e3)


def time_layers(calls, iters: int = 10) -> float:
    """Median ms of one call, the calls captured back to back in one graph."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        graph.replay()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return statistics.median(times)


def sweep_shape(name: str, batches: list[int], bandwidth: float) -> list[dict]:
    e, k, h, i = SHAPES[name]
    expert_bytes = 3 * h * i * 2
    layers = max(2, min(16, LAYERS_BYTES // (e * expert_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [((torch.randn(e, 2 * i, h, device="cuda", generator=gen) / h**0.5).bfloat16(),
                (torch.randn(e, h, i, device="cuda", generator=gen) / i**0.5).bfloat16()) for _ in range(layers)]
    rows = []
    for batch in batches:
        hidden = torch.randn(batch, h, device="cuda", dtype=torch.bfloat16)
        ids = [torch.rand(batch, e, device="cuda", generator=gen).topk(k, dim=-1).indices for _ in range(layers)]
        topw = torch.rand(batch, k, device="cuda", generator=gen).softmax(-1).bfloat16()
        hit = statistics.mean(len(torch.unique(x)) for x in ids)
        floor = hit * expert_bytes / bandwidth * 1e3
        chosen = moe.launch_config(e, i, batch, hidden.device)
        timings = []
        for launch in candidates(batch, pdl_supported(hidden.device)):
            calls = [lambda w=w, x=x, launch=launch: moe.run(hidden, w[0], w[1], topw, x, launch=launch)
                     for w, x in zip(weights, ids)]
            try:
                ms = time_layers(calls)
            except Exception as exc:  # a configuration that does not compile (shared memory) is skipped
                print(f"  {name} batch {batch} {launch}: {type(exc).__name__}", file=sys.stderr)
                continue
            timings.append({"launch": repr(launch), "ms": ms, "chosen": launch == chosen})
        timings.sort(key=lambda r: r["ms"])
        best, mine = timings[0], next((r for r in timings if r["chosen"]), None)
        rows.append({"shape": name, "batch": batch, "experts_hit": hit, "floor_ms": floor, "best": best,
                     "table_choice": mine, "timings": timings})
        mine_ms = f"{mine['ms'] * 1e3:.1f}" if mine else "-"
        print(f"{name:>18} batch {batch:>4}: hit {hit:5.1f}  floor {floor * 1e3:7.1f} us  table {mine_ms:>7} us  "
              f"best {best['ms'] * 1e3:7.1f} us ({100 * floor / best['ms']:.0f}% of floor)  {best['launch']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,256")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / f"fused_moe_sweep-{dt.date.today()}.json"))
    args = parser.parse_args()
    from ingot.ops.triton import register_cuda_kernels

    assert register_cuda_kernels(), "needs CUDA and triton"
    bandwidth = copy_bandwidth()
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for name in args.shapes.split(","):
        rows += sweep_shape(name, batches, bandwidth)
        torch.cuda.empty_cache()
    print(f"wrote {write_json(args.out, {'env': env_info(), 'copy_bandwidth': bandwidth, 'rows': rows})}")


if __name__ == "__main__":
    main()
