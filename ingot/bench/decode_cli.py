"""`ingot bench decode`: ms per decode step (eager, graph, compiled graph) per batch size.

For every batch size it reports ms per step, tokens/s, the speed-up of the
compiled graph over the graph, compile and capture seconds, and how close each
mode gets to the memory floor: the time to read every weight plus the KV
cache of the batch once (for mixture-of-experts models, the dense weights and
the experts the batch's routing is expected to hit: ``ModelBytes``), at the
device-to-device copy bandwidth measured in the same run. Timing needs CUDA;
the floor math, the summary, the table and the JSON/plot writers are plain
functions that also run on CPU.

``--gemm-floor`` also times the model's linear layers alone at each batch
size (one graph of every projection and the lm_head), so "graph - GEMMs" is
the time spent in attention, norms, rotary, activations and glue.
``--profile`` lists each bucket's kernels per graph-replayed step, and one
decoder layer's kernels in launch order (``step_profile.py``).
``--speculative-k 1,2,4,8`` also times, per batch size and draft count, speculative
decoding's verify step (batch x (k + 1) rows through a verify graph, then the
verification of greedy rows) against the plain decode step (``decode_spec.py``).

    ingot bench decode --shape qwen2.5-7b --batch-sizes 1,8,32,64,256 --json out.json --plot out.png
    ingot bench decode --model Qwen/Qwen2.5-1.5B-Instruct --decode-compile off
    ingot bench decode --shape qwen2.5-7b --compare-hf   # + transformers' static-cache compiled decode
    ingot bench decode --batch-sizes 1,64 --decode-compile off --gemm-floor --profile
    ingot bench decode --shape qwen3-30b-a3b --batch-sizes 1,8,16,32,64,256 --decode-compile auto
    ingot bench decode --shape qwen2.5-7b --tp 2 --batch-sizes 1,64   # two GPUs, tensor parallel
    ingot bench decode --shape qwen2.5-7b --batch-sizes 1,16,64 --speculative-k 1,2,4,8 --decode-compile off

With ``--tp N`` the model is split over N GPUs (one process each, ``cuda:0`` ..);
every timed step includes the broadcast of its inputs to the other ranks, and
the memory floor is one rank's: its shard of the weights and its KV heads.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from ingot.bench import decode_spec, report
from ingot.bench.decode import BucketTiming
from ingot.bench.floor import ModelBytes, copy_bandwidth, floor_fraction, floor_ms, tokens_per_s
from ingot.config import DTYPES
from ingot.loading.dummy import DEFAULT_SHAPE

log = logging.getLogger(__name__)

COMPILE_CHOICES = ("off", "on", "auto")
COPY_BYTES = 1 << 30  # size of the bandwidth probe (each of source and destination)


# ---------------------------------------------------------------------- results
@dataclass
class DecodeBench:
    """One run of the benchmark: what was timed, on what, and the per-batch timings."""

    source: str  # "shape qwen2.5-1.5b (random weights)" or the model path / hub id
    dtype: str
    context_len: int
    iters: int
    decode_compile: str  # off | on | auto, as asked
    modes: list[str]
    bandwidth: float  # bytes/s, measured device-to-device copy
    model_bytes: ModelBytes
    rows: list[BucketTiming]
    env: dict[str, Any] = field(default_factory=dict)
    tensor_parallel_size: int = 1  # the floor (model_bytes) is then one rank's
    quantization: str = "none"  # the model's (EngineConfig.quantization; none: the checkpoint's own)
    speculative_ks: list[int] = field(default_factory=list)  # draft counts of the verify steps timed


def summarize(bench: DecodeBench) -> list[dict[str, Any]]:
    """Per batch size: the floor, and per mode ms, tokens/s, fraction of floor, speed-ups, compile/capture s."""
    out = []
    for row in bench.rows:
        hits = row.experts_hit
        floor = floor_ms(bench.model_bytes, row.batch, bench.context_len, bench.bandwidth, hits)
        graph_ms = row.ms.get("graph")
        modes: dict[str, dict[str, Any]] = {}
        for mode in bench.modes:
            ms = row.ms.get(mode)
            if ms is None:
                continue
            queued = row.back_to_back_ms.get(mode)
            modes[mode] = {
                "ms": ms,
                "back_to_back_ms": queued,
                "back_to_back_floor_fraction": floor_fraction(floor, queued) if queued is not None else None,
                "tokens_per_s": tokens_per_s(row.batch, ms),
                "floor_fraction": floor_fraction(floor, ms),
                "speedup_vs_graph": graph_ms / ms if graph_ms is not None else None,
                "warmup_s": row.warmup_s.get(mode),
                "capture_s": row.capture_s.get(mode),
                "sm_clock_mhz": row.gpu_state.get(mode, {}).get("sm_clock_mhz"),
            }
        compiled_ms = row.ms.get("compiled")
        gemm_ms = row.ms.get("gemm_only")
        out.append({
            "batch": row.batch,
            "weight_bytes_read": bench.model_bytes.weight_bytes_read(row.batch, hits),
            "experts_hit_per_layer": bench.model_bytes.experts_hit(row.batch, hits),
            "experts_hit_counted": hits is not None,
            "experts_hit_uniform": bench.model_bytes.experts_hit(row.batch),
            "kv_bytes": bench.model_bytes.kv_bytes(row.batch, bench.context_len),
            "step_bytes": bench.model_bytes.step_bytes(row.batch, bench.context_len, hits),
            "floor_ms": floor,
            "compiled_speedup_vs_graph": graph_ms / compiled_ms if graph_ms is not None and compiled_ms is not None else None,
            "graph_minus_gemm_ms": graph_ms - gemm_ms if graph_ms is not None and gemm_ms is not None else None,
            "modes": modes,
        })
    return out


def to_json(bench: DecodeBench) -> dict[str, Any]:
    """Everything measured (raw BucketTiming rows) and everything derived (summary)."""
    return {
        "command": "ingot bench decode",
        "env": bench.env,
        "source": bench.source,
        "quantization": bench.quantization,
        "dtype": bench.dtype,
        "context_len": bench.context_len,
        "iters": bench.iters,
        "decode_compile": bench.decode_compile,
        "tensor_parallel_size": bench.tensor_parallel_size,
        "modes": list(bench.modes),
        "copy_bandwidth_bytes_per_s": bench.bandwidth,
        "model_bytes": asdict(bench.model_bytes),
        "timings": [asdict(r) for r in bench.rows],
        "summary": summarize(bench),
        "speculative_ks": list(bench.speculative_ks),
        "speculative": decode_spec.summarize(bench.rows),
    }


def make_table(bench: DecodeBench):
    """One row per (batch size, mode); a separator between batch sizes."""
    summary = summarize(bench)
    clocks = any(m["sm_clock_mhz"] is not None for s in summary for m in s["modes"].values())
    columns = ["batch", "mode", "ms/step", "back-to-back", "tokens/s", "vs graph", "% of floor", "floor ms", "warm-up s",
               "capture s"] + (["SM MHz"] if clocks else [])
    rows: list[list[str]] = []
    ends: list[int] = []
    for s in summary:
        for i, (mode, m) in enumerate(s["modes"].items()):
            rows.append([
                str(s["batch"]) if i == 0 else "",
                mode,
                report.fmt(m["ms"], ".3f"),
                report.fmt(m["back_to_back_ms"], ".3f"),
                report.fmt(m["tokens_per_s"], ",.0f"),
                report.fmt(m["speedup_vs_graph"], ".2f") + ("x" if m["speedup_vs_graph"] is not None else ""),
                report.fmt(100 * m["floor_fraction"], ".1f"),
                report.fmt(s["floor_ms"], ".3f") if i == 0 else "",
                report.fmt(m["warmup_s"], ".1f"),
                report.fmt(m["capture_s"], ".3f"),
            ] + ([report.fmt(m["sm_clock_mhz"], ".0f")] if clocks else []))
        ends.append(len(rows) - 1)
    bw = bench.bandwidth / 1e9
    quant = "" if bench.quantization == "none" else f", {bench.quantization}"
    title = f"decode step, {bench.source}{quant}, {bench.dtype}, context {bench.context_len} (median of {bench.iters})"
    mb = bench.model_bytes
    weights = f"{mb.weight_bytes / 1e9:.2f} GB weights"
    if mb.moe_layers:
        counted = all(s["experts_hit_counted"] for s in summary)
        hit = "counted from the step's routing" if counted else "uniform routing"
        per_batch = ", ".join(f"{s['experts_hit_per_layer']:.1f} at {s['batch']}" for s in summary)
        weights = (f"{mb.weight_bytes / 1e9:.2f} GB dense weights + {mb.moe_layers} layers x experts hit "
                   f"({hit}: {per_batch}) x {mb.expert_bytes / 1e6:.1f} MB")
    kv = "KV of the batch" + (", sliding layers' up to their window" if any(mb.layer_windows) else "")
    caption = (f"ms/step: each step timed alone (the device waits while the host launches it); back-to-back: "
               f"steps queued while the one before runs, as overlap scheduling does; floor = ({weights} + {kv}) "
               f"/ {bw:,.0f} GB/s copy bandwidth; warm-up includes the compile"
               + ("; SM MHz: the SM clock right after the back-to-back steps (NVML)" if clocks else ""))
    return report.make_table(title, columns, rows, right_align=columns[2:] + ["batch"], section_ends=ends, caption=caption)


def quant_table(benches: list[DecodeBench]):
    """The quantizations side by side: per batch, each one's graph step (alone and back to back),
    its floor from the bytes it reads, and its speed-up over the first."""
    columns = ["batch", "quantization", "weights GB", "graph ms", "back-to-back", "floor ms", "% of floor", "vs first"]
    rows: list[list[str]] = []
    ends: list[int] = []
    summaries = [summarize(b) for b in benches]
    for i, batch_rows in enumerate(zip(*summaries)):
        first = batch_rows[0]["modes"].get("graph", {}).get("back_to_back_ms")
        for j, (bench, s) in enumerate(zip(benches, batch_rows)):
            graph = s["modes"].get("graph", {})
            queued = graph.get("back_to_back_ms")
            rows.append([
                str(s["batch"]) if j == 0 else "", bench.quantization, f"{s['weight_bytes_read'] / 1e9:.2f}",
                report.fmt(graph.get("ms"), ".3f"), report.fmt(queued, ".3f"), report.fmt(s["floor_ms"], ".3f"),
                report.fmt(100 * graph["back_to_back_floor_fraction"], ".1f") if queued else "-",
                report.fmt(first / queued, ".2f") + "x" if first and queued else "-",
            ])
        ends.append(len(rows) - 1)
    title = f"decode step by quantization, {benches[0].source}, context {benches[0].context_len}"
    caption = ("floor: the bytes each quantization's step reads (its weights as stored, scales included, and the "
               "KV of the batch) at the copy bandwidth measured in this run; vs first: back-to-back speed-up")
    return report.make_table(title, columns, rows, right_align=columns[2:] + ["batch"], section_ends=ends, caption=caption)


def profile_lines(bench: DecodeBench, top: int = 12) -> list[str]:
    """Per profiled batch size and mode: step time, kernel time and launches, the gaps, the top
    kernels, and one decoder layer's kernels in launch order where the step folds into its layers.

    Between kernels: the back-to-back step less its kernels (gaps inside the graph);
    host: a step timed alone less the back-to-back one (the device idle while the host
    copies the inputs and launches the graph)."""
    lines = []
    for row in bench.rows:
        for mode, prof in row.profiles.items():
            step_us = 1e3 * row.ms[mode]
            queued_us = 1e3 * row.back_to_back_ms.get(mode, row.ms[mode])
            lines.append(f"batch {row.batch}, {mode}: step {step_us:.1f} us alone, {queued_us:.1f} us back to back; "
                         f"kernels {prof.kernel_us:.1f} us ({prof.launches:.0f} launches), between kernels "
                         f"{queued_us - prof.kernel_us:.1f} us, host {step_us - queued_us:.1f} us")
            lines += [f"  {us:8.1f} us {n:5.0f}x  {name}" for name, n, us in prof.kernels[:top]]
            if prof.layer:
                lines.append(f"  a layer, {sum(span for _, span, _ in prof.layer):.1f} us: each kernel from the end of the "
                             "one before to its end (its own time), median over layers and replays")
                lines += [f"    {span:7.2f} us ({us:6.2f})  {name[:70]}" for name, span, us in prof.layer]
    return lines


def plot(bench: DecodeBench, path: str) -> None:
    """ms per step against batch size, one line per mode, the memory floor dashed."""
    summary = summarize(bench)
    x = [s["batch"] for s in summary]
    series: dict[str, list[Optional[float]]] = {
        mode: [s["modes"].get(mode, {}).get("ms") for s in summary] for mode in bench.modes
    }
    series["memory floor"] = [s["floor_ms"] for s in summary]
    report.plot_lines(
        path, x, series, dashed=["memory floor"], xlabel="batch size", ylabel="ms per decode step",
        title=f"{bench.source}, {bench.dtype}, context {bench.context_len}",
    )


# ---------------------------------------------------------------------- measuring (CUDA)
def modes_for(decode_compile: str) -> list[str]:
    """off: eager + graph; on: + compiled graph; auto: + compiled + auto's per-bucket choice."""
    return {"off": ["eager", "graph"], "on": ["eager", "graph", "compiled"],
            "auto": ["eager", "graph", "compiled", "auto"]}[decode_compile]


def measure_copy_bandwidth(device: Any, nbytes: int = COPY_BYTES, iters: int = 20) -> float:
    """Bytes/s of a large device-to-device copy, timed with CUDA events (median)."""
    import torch

    from ingot.bench.decode import time_cuda

    free, _ = torch.cuda.mem_get_info(device)
    nbytes = max(1 << 20, min(nbytes, free // 4))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), iters, device, warmup=5)
    del src, dst
    torch.cuda.empty_cache()
    return copy_bandwidth(nbytes, ms)


def engine_config(args: argparse.Namespace) -> Any:
    """The EngineConfig of the timed model: --model / --shape (default: the default shape), --tp."""
    from ingot.engine_args import model_overrides
    from ingot.config import EngineConfig

    overrides = model_overrides(args)
    overrides.setdefault("model", DEFAULT_SHAPE)
    if "load_format" not in overrides and overrides["model"] == DEFAULT_SHAPE and args.model is None:
        overrides["load_format"] = "dummy"
    return EngineConfig.create(dtype=args.dtype, device=args.device, tensor_parallel_size=args.tp,
                               show_progress=not args.quiet, **overrides)


def source_label(config: Any, tp: int) -> str:
    """What the table's title calls the model."""
    label = config.model if config.load_format != "dummy" else f"shape {config.model} (random weights)"
    return label if tp == 1 else f"{label}, tensor parallel over {tp}"


def run(args: argparse.Namespace, device: Any) -> list[DecodeBench]:
    """One bench per ``--quantization`` (in the order given), timed in one process."""
    import torch

    modes = modes_for(args.decode_compile) + (["gemm_only"] if args.gemm_floor else [])
    if args.tp > 1 and (args.gemm_floor or args.profile or getattr(args, "compare_hf", False)):
        raise report.ReportError("--gemm-floor, --profile and --compare-hf time one GPU's kernels: run them without --tp")
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # CUDA events and copies run on the current device
    bandwidth = measure_copy_bandwidth(device)
    config = engine_config(args)
    return [run_one(args, device, config.replace(quantization=None if q == "none" else q), modes, bandwidth)
            for q in args.quantization]


def run_one(args: argparse.Namespace, device: Any, config: Any, modes: list[str], bandwidth: float) -> DecodeBench:
    import torch

    from ingot.bench.decode import bench_decode, decode_engine, dtype_of

    ks = args.speculative_k or []
    engine = decode_engine(config, args.batch_sizes, args.context_len, drafts=max(ks, default=0))
    try:
        rows, model_bytes = engine.executor.run_on_ranks(bench_decode, args.batch_sizes, args.context_len, modes,
                                                         args.iters, args.profile or 0, ks)
        dtype = engine.executor.run_on_ranks(dtype_of)
    finally:
        engine.close()
    bench = DecodeBench(
        source=source_label(config, args.tp),
        dtype=str(dtype).removeprefix("torch."),
        context_len=args.context_len,
        iters=args.iters,
        decode_compile=args.decode_compile,
        modes=modes,
        bandwidth=bandwidth,
        model_bytes=model_bytes,
        rows=rows,
        env=report.env_info(),
        tensor_parallel_size=args.tp,
        quantization=config.quantization or "none",
        speculative_ks=ks,
    )
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if getattr(args, "compare_hf", False):
        from ingot.bench import hf_compare

        hf_compare.add_hf_mode(bench, args, device, dtype)
    return bench


def _cuda_device(name: str):
    """The CUDA device to time on, or None (with the reason printed) if there is none."""
    import torch

    if not torch.cuda.is_available():
        why = "PyTorch sees no CUDA GPU"
    elif name != "auto" and not name.startswith("cuda"):
        why = f"--device {name} is not a CUDA device"
    else:
        return torch.device("cuda" if name == "auto" else name)
    print(f"ingot bench decode: error: timing decode steps needs a CUDA GPU ({why}); "
          "run it on a machine with CUDA (for a CPU check of graphs vs eager use `ingot check drift --fake-graphs`)",
          file=sys.stderr)
    return None


def cmd_decode(args: argparse.Namespace) -> int:
    try:
        if args.plot:
            report.require_matplotlib()  # fail before minutes of timing, not after
        device = _cuda_device(args.device)
        if device is None:
            return 2
        benches = run(args, device)
        console = report.console(width=160)
        for bench in benches:
            console.print(make_table(bench))
            for row in bench.rows:
                if row.auto_choice:
                    print(f"auto, batch {row.batch}: {row.auto_choice}")
            for s in summarize(bench):
                if s["graph_minus_gemm_ms"] is not None:
                    print(f"batch {s['batch']}: graph - GEMMs {s['graph_minus_gemm_ms']:.3f} ms")
            for line in profile_lines(bench):
                print(line)
            if bench.speculative_ks:
                console.print(decode_spec.make_table(bench.source, bench.context_len, bench.iters, bench.rows))
        if len(benches) > 1:
            console.print(quant_table(benches))
        if args.json:
            doc = to_json(benches[0]) if len(benches) == 1 else {"command": "ingot bench decode",
                                                                  "runs": [to_json(b) for b in benches]}
            print(f"wrote {report.write_json(args.json, doc)}")
        if args.plot:
            plot(benches[0], args.plot)
            print(f"wrote {args.plot}")
    except report.ReportError as exc:
        print(f"ingot bench decode: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _quantizations(text: str) -> list[str]:
    from ingot.config import QUANTIZATIONS

    names = ["none" if q.strip() in ("bf16", "none", "") else q.strip() for q in text.split(",")]
    bad = [q for q in names if q != "none" and q not in QUANTIZATIONS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown quantization {bad[0]!r}; choose from none, {', '.join(QUANTIZATIONS)}")
    return list(dict.fromkeys(names))


def add_parser(subparsers) -> None:
    # Not add_engine_args: its --decode-compile is a flag, here it picks which modes to time.
    p = subparsers.add_parser(
        "decode",
        help="ms per decode step (eager, graph, compiled graph) per batch size, against the memory floor",
        description="Time decode steps per batch size with CUDA events: eager, CUDA graph and compiled graph; "
                    "tokens/s, compiled-vs-graph speed-up and the fraction of the memory floor "
                    "(weights + KV read once at the measured copy bandwidth). Needs CUDA.",
    )
    from ingot.engine_args import add_model_args

    add_model_args(p.add_argument_group(f"model (default: --shape {DEFAULT_SHAPE})"), quantization=False)
    p.add_argument("--quantization", "-q", type=_quantizations, default=["none"], metavar="Q,Q,...",
                   help="quantizations to time side by side, each its own engine: none (the checkpoint as it is; "
                        "bf16 is an alias), fp8, int8, int4 (online), or a checkpoint's own method (default none)")
    p.add_argument("--batch-sizes", type=report.positive_int_list, default=[1, 8, 32, 64, 256], metavar="N,N,...",
                   help="batch sizes to time (default 1,8,32,64,256)")
    p.add_argument("--context-len", type=report.positive_int, default=512, help="cached tokens per sequence (default 512)")
    p.add_argument("--decode-compile", choices=COMPILE_CHOICES, default="on",
                   help="off: time eager + graph; on: eager + graph + compiled graph (default); auto: also decode_compile=auto, "
                        "which keeps a bucket's compiled graph only where it is faster without drift")
    p.add_argument("--compare-hf", action="store_true",
                   help="also time Hugging Face transformers' decode on the same model and batch sizes "
                        "(StaticCache + torch.compile reduce-overhead, fullgraph) as mode hf_static_compiled; "
                        "needs transformers")
    p.add_argument("--gemm-floor", action="store_true",
                   help="also time the model's linear layers alone (mode gemm_only) and report graph - GEMMs")
    p.add_argument("--profile", type=report.positive_int, nargs="?", const=10, default=None, metavar="STEPS",
                   help="list each batch size's kernels per graph-replayed step (torch.profiler over STEPS replays, default 10)")
    p.add_argument("--speculative-k", type=decode_spec.speculative_ks, default=None, metavar="K,K,...",
                   help="also time speculative decoding's verify step with K drafts per sequence (batch x (K + 1) "
                        "rows through a verify graph, then greedy verification) against the plain decode step, "
                        "per batch size, in the graph and compiled modes")
    p.add_argument("--iters", type=report.positive_int, default=30, help="timed steps per mode and batch size; the median is reported (default 30)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every number to this JSON file")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="plot ms/step vs batch size (needs matplotlib)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto = bf16 on CUDA")
    p.add_argument("--device", default="auto", help="auto or cuda[:N]")
    p.add_argument("--tensor-parallel-size", "--tp", dest="tp", type=report.positive_int, default=1, metavar="N",
                   help="split the model over N GPUs (cuda:0 ..; default 1); each step includes the broadcast of its inputs")
    p.add_argument("--quiet", action="store_true", help="no progress bars or logs")
    p.set_defaults(func=cmd_decode)
