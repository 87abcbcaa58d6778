"""Launch candidates of the batch-1 GEMV, decode attention and fused-MoE kernels, timed inside the whole decode step.

    python -m benchmarks.step_launch_sweep --shape mixtral-8x7b [--kernel skinny,router,o_router,attention,moe,pdl]
        [--only TEXT ...] [--rounds 2] [--out PATH]

``benchmarks/kernels.py --sweep skinny`` and ``benchmarks/fused_moe_sweep.py`` time a
kernel alone on a flushed L2. Inside a step its neighbours, TLB misses on fresh weights
and the split-K merges change the picture, so this script swaps one launch at a time
into the tables the ops read (``skinny_gemm.launch_config``,
``decode_attention.launch_config``, ``fused_moe._TABLE``; ``pdl``: the three kernels' ``launch_config`` with
programmatic dependent launch switched), captures the random-weight
model's batch-1 decode graph, and times replays queued back to back
(``ingot.bench.decode.time_back_to_back``). Rounds interleave the candidates; each
candidate's figure is its median over rounds, against the table's. The tables are
restored afterwards. On the H200 the first two or three candidates of a process replayed
~5% faster than every later one, whichever launch they held (the GPU's clocks under
sustained load, or where the later captures' buffers land: not yet told apart), so the
table's graph is first captured, replayed and dropped over ``--warmup-s`` seconds, untimed. Needs CUDA; prints a table and writes JSON (default
benchmarks/results/step_launch_sweep-<shape>-<date>.json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ingot.bench.decode import SHAPES, build_shape, decode_bench_runner, synthetic_decode_batch, time_back_to_back  # noqa: E402
from ingot.bench.gpu_state import gpu_state  # noqa: E402
from ingot.bench.report import env_info, write_json  # noqa: E402
from ingot.config import EngineConfig  # noqa: E402
from ingot.ops.triton import decode_attention as attention  # noqa: E402
from ingot.ops.triton import fused_moe as moe  # noqa: E402
from ingot.ops.triton import skinny_gemm as skinny  # noqa: E402
from ingot.ops.triton._common import num_sms  # noqa: E402

# skinny GEMM variants for the wide projections (1,024 to 16,384 outputs; the router and lm_head keep the table's)
SKINNY_VARIANTS: dict[str, dict] = {
    "whole K": {"splits": 1},
    "whole K, half-height tiles": {"splits": 1, "block_n": 8},
    "2 K splits": {"splits": 2},
    "2 programs an SM": {"waves": 2},
    "8 programs an SM": {"waves": 8},
    "512-wide K tiles": {"block_k": 512},
    "128-wide K tiles": {"block_k": 128},
    "8 warps": {"num_warps": 8},
}
# and for the MoE routers (at most 256 outputs: 8 to 128 experts, Qwen2-MoE's shared-expert gate row
# included), latency-bound GEMVs of 64 KB to 1 MB; blocks without a shared expert run their router in
# o_proj's launch at one row (``linear_norm_linear_scaled``), which the wide-projection variants reach
ROUTER_VARIANTS: dict[str, dict] = {
    "whole K": {"splits": 1},
    "whole K, 4-row tiles": {"splits": 1, "block_n": 4},
    "whole K, 8-row tiles": {"splits": 1, "block_n": 8},
    "4-row tiles": {"block_n": 4},
    "2 K splits": {"splits": 2},
    "1 warp": {"num_warps": 1},
    "2 warps": {"num_warps": 2},
    "128-wide K tiles": {"block_k": 128},
    "8 programs an SM": {"waves": 8},
}
# and for o_proj with the router epilogue alone (``linear_norm_linear_scaled``): the wide-projection
# variants, and the router's last tile, which adds one share per o_proj tile: wider tiles leave it
# fewer to add (the table: 32-row tiles, the shares in 8,192-float rounds; 16,384 cost more
# registers than the round it saved)
O_ROUTER_VARIANTS: dict[str, dict] = {
    "16-row tiles": {"block_n": 16},
    "64-row tiles": {"block_n": 64},
    **SKINNY_VARIANTS,
}
# decode attention at batch 1 (the latency-bound branch of its table: fewer (sequence, KV head)
# programs than half the SMs)
ATTENTION_VARIANTS: dict[str, dict] = {
    "32-token tiles": {"block_n": 32},
    "32-token tiles, 4 warps": {"block_n": 32, "num_warps": 4},
    "128-token tiles": {"block_n": 128},
    "4 warps": {"num_warps": 4},
    "1 stage": {"num_stages": 1},
    "3 stages": {"num_stages": 3},
    "2 programs an SM": {"waves": 2},
}

# programmatic dependent launch (``ingot/ops/triton/pdl.py``), switched per kernel family at
# every batch: (skinny GEMM, decode attention, fused MoE) changes
PDL_VARIANTS: dict[str, tuple[dict, dict, dict]] = {
    "off": ({"pdl": False}, {"pdl": False}, {"pdl": False}),
    "GEMV only": ({}, {"pdl": False}, {"pdl": False}),
    "not attention": ({}, {"pdl": False}, {}),
    "not MoE": ({}, {}, {"pdl": False}),
}

# candidate families --kernel takes: skinny GEMVs of the wide projections (o_proj with the router
# epilogue included), of the routers, of o_proj with the router epilogue alone, decode attention,
# fused-MoE per-pair tiles, PDL
FAMILIES = ("skinny", "router", "o_router", "attention", "moe", "pdl")
WARMUP_CAPTURES = 4  # the table's graph captured this often during --warmup-s
# fused-MoE per-pair tiles (BLOCK_N, BLOCK_K, warps, stages)
MOE_TILES = [(4, 256, 4, 4), (8, 256, 4, 4), (16, 256, 4, 4), (32, 256, 4, 4), (8, 512, 4, 4), (16, 512, 4, 4),
             (16, 128, 4, 4), (16, 256, 8, 4), (16, 256, 4, 3)]


def skinny_candidates(kind: str = "skinny") -> dict[str, Callable[[], Callable[[], None]]]:
    """name -> install(): swaps ``skinny_gemm.launch_config`` for one-row GEMVs of the wide
    projections (``kind`` "skinny"), of the routers ("router") or of o_proj with the router
    epilogue ("o_router"), and returns the undo."""
    table = skinny.launch_config
    variants, lo, hi = {"skinny": (SKINNY_VARIANTS, 1024, 16384), "router": (ROUTER_VARIANTS, 1, 256),
                        "o_router": (O_ROUTER_VARIANTS, 1, 16384)}[kind]

    def install(changes: dict) -> Callable[[], None]:
        def pick(m, n, k, device, prologue=skinny.NONE, router=False):
            cfg = table(m, n, k, device, prologue, router)
            if m != 1 or not lo <= n <= hi or (kind == "o_router" and not router):
                return cfg
            ch = dict(changes)
            if "block_n" in ch and prologue != skinny.NONE:
                ch["block_n"] *= 2  # the prologue tiles are twice as tall in the table too
            return replace(cfg, **ch)

        skinny.launch_config = pick
        return lambda: setattr(skinny, "launch_config", table)

    return {f"{kind}: {name}": (lambda ch=ch: install(ch)) for name, ch in variants.items()}


def attention_candidates() -> dict[str, Callable[[], Callable[[], None]]]:
    """name -> install(): swaps ``decode_attention.launch_config`` for the latency-bound
    launches (few programs: batch 1), and returns the undo."""
    table = attention.launch_config

    def install(changes: dict) -> Callable[[], None]:
        def pick(head_dim, programs, device):
            cfg = table(head_dim, programs, device)
            return cfg if 2 * programs >= num_sms(device) else replace(cfg, **changes)

        attention.launch_config = pick
        return lambda: setattr(attention, "launch_config", table)

    return {f"attention: {name}": (lambda ch=ch: install(ch)) for name, ch in ATTENTION_VARIANTS.items()}


def moe_candidates(experts: int, width: int) -> dict[str, Callable[[], Callable[[], None]]]:
    """name -> install(): the one-token row of ``fused_moe._TABLE`` for this shape with other tiles."""
    rows = moe._TABLE["sm90"].get((experts, width))
    if rows is None or rows[0][1].grouped:
        return {}  # no per-pair row of its own for this shape
    first = rows[0][1]
    out = {}
    for part in ("gate_up", "down"):
        for tiles in MOE_TILES:
            if tiles == getattr(first, part):
                continue
            launch = replace(first, **{part: tiles})

            def install(launch=launch) -> Callable[[], None]:
                moe._TABLE["sm90"][(experts, width)] = ((rows[0][0], launch),) + rows[1:]
                return lambda: moe._TABLE["sm90"].__setitem__((experts, width), rows)

            out[f"moe {part}: {tiles}"] = install
    return out


def pdl_candidates() -> dict[str, Callable[[], Callable[[], None]]]:
    """name -> install(): swaps the three kernels' ``launch_config`` for ones with PDL switched
    (``PDL_VARIANTS``), and returns the undo."""
    tables = (skinny.launch_config, attention.launch_config, moe.launch_config)

    def install(changes: tuple[dict, dict, dict]) -> Callable[[], None]:
        for module, table, ch in zip((skinny, attention, moe), tables, changes):
            module.launch_config = (lambda *a, table=table, ch=ch, **kw: replace(table(*a, **kw), **ch))

        def undo() -> None:
            skinny.launch_config, attention.launch_config, moe.launch_config = tables
        return undo

    return {f"pdl: {name}": (lambda ch=ch: install(ch)) for name, ch in PDL_VARIANTS.items()}


def graph_step_us(runner, config: EngineConfig, per_seq: int, inputs, steps: int, until: float = 0.0) -> float:
    """us a batch-1 step of a graph captured now with the tables as they stand, replays queued
    back to back; timed again until ``time.monotonic()`` passes ``until`` (the last timing counts).
    The graph is dropped afterwards."""
    graphs = runner.decode_variant(config, per_seq)
    try:
        while True:
            us = 1e3 * time_back_to_back(lambda: runner.logits_of(graphs, inputs), steps, runner.device)
            if time.monotonic() >= until:
                return us
    finally:
        runner.drop_variant(graphs)
        del graphs
        torch.cuda.empty_cache()


def keep_matching(candidates: dict[str, Callable], texts: list[str]) -> dict[str, Callable]:
    """The table and the candidates whose name contains one of ``texts`` (``--only``), in sweep order."""
    return {name: c for name, c in candidates.items() if name == "table" or any(t in name for t in texts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--kernel", default="skinny,moe",
                    help=f"comma-separated candidate families, of {', '.join(FAMILIES)} (default skinny,moe)")
    ap.add_argument("--only", action="append", default=[], metavar="TEXT",
                    help="repeatable: keep the candidates whose name contains one of these texts (the table always runs), "
                         "to rerun a sweep's closest candidates with more rounds")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved passes over the candidates (default 2)")
    ap.add_argument("--warmup-s", type=float, default=15.0,
                    help="seconds of untimed captures and replays of the table's graph before the rounds (default 15)")
    ap.add_argument("--steps", type=int, default=30, help="replays queued per timing (default 30)")
    ap.add_argument("--context-len", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kernels = [k.strip() for k in args.kernel.split(",") if k.strip()]
    unknown = sorted(set(kernels) - set(FAMILIES))
    if unknown or not kernels:
        ap.error(f"--kernel: unknown candidate families {unknown}; choose from {', '.join(FAMILIES)}")
    if not torch.cuda.is_available():
        sys.exit("step_launch_sweep needs CUDA")
    dev = torch.device("cuda")
    model, cfg = build_shape(args.shape, torch.bfloat16, dev, args.context_len + 64)
    base, runner, per_seq = decode_bench_runner(model, cfg, EngineConfig.create(show_progress=False), [1],
                                                args.context_len, torch.bfloat16)
    candidates: dict[str, Callable[[], Callable[[], None]]] = {"table": lambda: (lambda: None)}
    for family in kernels:
        if family in ("skinny", "router", "o_router"):
            candidates.update(skinny_candidates(family))
        elif family == "attention":
            candidates.update(attention_candidates())
        elif family == "pdl":
            candidates.update(pdl_candidates())
        elif cfg.num_experts:
            candidates.update(moe_candidates(cfg.num_experts, cfg.moe_intermediate_size))
    if args.only:
        candidates = keep_matching(candidates, args.only)
        if len(candidates) == 1:
            sys.exit(f"--only {args.only} matches no candidate of --kernel {args.kernel}")
    inputs = runner.stage(synthetic_decode_batch(1, args.context_len, base.block_size, cfg.vocab_size))
    graph = base.replace(decode_compile=False)
    for _ in range(WARMUP_CAPTURES):  # past the first candidates' faster replays (module docstring)
        graph_step_us(runner, graph, per_seq, inputs, args.steps, time.monotonic() + args.warmup_s / WARMUP_CAPTURES)
    us: dict[str, list[float]] = {name: [] for name in candidates}
    states: dict[str, list] = {name: [] for name in candidates}  # the GPU's state after each timing (NVML)
    for rnd in range(args.rounds):
        for name, install in candidates.items():
            undo = install()
            try:
                us[name].append(graph_step_us(runner, graph, per_seq, inputs, args.steps))
                states[name].append(gpu_state(dev))
            finally:
                undo()
            state = states[name][-1]
            clock = f", SM {state['sm_clock_mhz']} MHz {'/'.join(state['clock_limits'])}" if state else ""
            print(f"round {rnd} {name:40s} {us[name][-1]:9.1f} us a step{clock}", flush=True)
    table_us = statistics.median(us["table"])
    print(f"\n{args.shape}, batch 1, graph steps back to back (median of {args.rounds} rounds)")
    rows = []
    for name, runs in sorted(us.items(), key=lambda kv: statistics.median(kv[1])):
        med = statistics.median(runs)
        rows.append({"candidate": name, "us_per_step": runs, "median_us": med, "vs_table": med / table_us,
                     "gpu_states": states[name]})
        print(f"  {name:40s} {med:9.1f} us  {med / table_us:6.3f}x the table   rounds: "
              + " ".join(f"{x:.1f}" for x in runs))
    date = dt.date.today().isoformat()
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"step_launch_sweep-{args.shape}-{date}.json"
    write_json(out, {"command": "python -m benchmarks.step_launch_sweep " + " ".join(sys.argv[1:]), "env": env_info(),
                     "shape": args.shape, "context_len": args.context_len, "rounds": args.rounds, "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
