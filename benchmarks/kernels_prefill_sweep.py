"""``python -m benchmarks.kernels --sweep prefill``: tiles of the fused and context kernels,
every path on a grid of shapes, the launch rule fitted to those timings (``PREFILL_RULES``),
and two cuDNN probes."""

from __future__ import annotations

import torch

from benchmarks.kernel_timing import bench, host_us, time_row
from benchmarks.kernels_prefill import PREFILL_PATHS, PREFILL_SHAPES, prefill_call, prefill_shape_args

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


def sweep_prefill(matmul_tflops: float, groups: list) -> dict:
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
            if not pd.path_supported(path, *prefill_shape_args(call)):
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
            args = prefill_shape_args(call)
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
    if pd.path_supported("flash", *prefill_shape_args(call)):
        res["flash_path_do_bench_ms"] = bench(lambda: pd.prefill_attention(*call, path="flash"))
    print(f"# cuDNN varlen (8x512, 28/4): {res}")
    return res


def _cudnn_new_length_cost():
    """Host + GPU ms of the cuDNN path's first call at a prompt length it has not seen
    (PyTorch builds and caches one cuDNN execution plan per shape) and of the next call."""
    import time

    from ingot.ops.triton import prefill_dispatch as pd

    call, _ = prefill_call([3001], [3001], 12, 2, 128)
    if not pd.path_supported("cudnn", *prefill_shape_args(call)):
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
