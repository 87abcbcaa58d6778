"""`ingot serve` against the offline engine on the same workload, alternated in one run.

    python -m benchmarks.serve_vs_offline --shape qwen2.5-1.5b --tokenizer default --max-model-len 2048 \\
        --num-requests 1000 --input-len 64-1024 --output-len 64-512 --rounds 4 --json out.json

Why alternated: on a shared GPU host one run of a serving workload can differ from the
next by 40%, and the machine drifts within minutes, so an offline run measured first and
a server run measured after (or the other way round) compare two machine states. Here
both live at once on one GPU: the server (a subprocess of ``ingot serve``, given
``--server-memory`` of the GPU for its weights and KV cache) and an offline engine in
this process (the rest of the memory budget, ``gpu_memory_utilization`` as usual counts
every process's memory). Each round runs the workload offline and over HTTP, the order
alternating between rounds; round ``r`` draws its prompts with seed ``seed + r`` for both,
so the server's prefix cache never holds a later round's prompts, and the offline engine
empties its own before each run. The first ``--warmup-rounds`` rounds are recorded but not
counted. The HTTP client runs as ``--client-processes`` processes (default 4; one reads
about 28,000 streamed chunks/s, below what a 512-sequence batch on a GPU streams). Reports
each round's output tokens/s, the HTTP / offline ratio, and the median ratio; TTFT, TPOT
and ITL p50 of both. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from ingot.bench.report import env_info, write_json
from ingot.bench.serve import round_order, round_summary, run_workload, warm_up
from ingot.bench.workload import Workload, make_requests, parse_range
from ingot.engine.heap import freeze_heap, unfreeze_heap
from ingot.engine_args import add_model_args

READY = re.compile(r"ingot serve: ready on (http://\S+)")


def model_args(args: argparse.Namespace) -> list[str]:
    """The model and engine options both engines get (``ingot serve`` and ``ingot bench serve`` take the same)."""
    out = ["--shape", args.shape] if args.shape else (["--model", args.model] if args.model else [])
    for flag, value in (("--load-format", args.load_format), ("--tokenizer", args.tokenizer)):
        if value:
            out += [flag, value]
    for flag, value in (("--max-model-len", args.max_model_len), ("--max-num-seqs", args.max_num_seqs),
                        ("--device", args.device), ("--dtype", args.dtype)):
        if value is not None:
            out += [flag, str(value)]
    return out


class ServerProcess:
    """``ingot serve`` on a free port in a subprocess; always stopped by ``stop``."""

    def __init__(self, args: argparse.Namespace, memory: float, timeout: float) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ingot-serve-", suffix=".log", delete=False)
        env = dict(os.environ, INGOT_GPU_MEMORY_UTILIZATION=str(memory))
        cmd = [sys.executable, "-m", "ingot", "serve", *model_args(args), "--port", "0", "--quiet",
               "--api-server-count", str(args.api_server_count)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = Path(self.log.name).read_text(errors="replace")
            found = READY.search(text)
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"ingot serve exited with code {self.proc.returncode}:\n{text[-2000:]}")
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"ingot serve was not ready within {timeout:.0f} s")

    def stop(self, grace: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # a clean shutdown: abort in-flight, exit 0
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)


def build_offline_engine(args: argparse.Namespace):
    """The offline engine, built from the same model options by ``ingot bench serve``'s own
    parser and engine builder (so it is configured exactly as that command configures it:
    decode compile off, prefix caching and overlap scheduling on, as ``ingot serve``'s defaults)."""
    from ingot.bench.serve_cli import MODES, build_engine
    from ingot.cli import build_parser

    bench_args = build_parser().parse_args(["bench", "serve", *model_args(args), "--quiet"])
    return build_engine(bench_args, MODES["off"])


LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"))


def summary(metrics: Any) -> dict[str, Any]:
    """The numbers of one run compared here (``metrics``: ServeMetrics): ``round_summary``'s,
    the engine's steps, and the TTFT, TPOT and ITL statistics (mean, p50, p90, p99)."""
    return {**round_summary(metrics), "prefill_steps": metrics.prefill_steps, "decode_steps": metrics.decode_steps,
            **{key: getattr(metrics, key) for key, _ in LATENCIES}}


def run_rounds(args: argparse.Namespace, engine, url: str) -> list[dict[str, Any]]:
    from ingot.bench.http_serve import run_http
    from ingot.engine import event_loop

    vocab = engine.model_config.vocab_size
    rounds = []
    for r in range(args.warmup_rounds + args.rounds):
        workload = Workload(args.num_requests, args.input_len, args.output_len, seed=args.seed + r)
        requests = make_requests(workload, vocab)
        runs: dict[str, dict[str, Any]] = {}
        for mode in round_order(["offline", "http"], r):
            if mode == "offline":
                assert engine.reset_prefix_cache(), "the offline engine is idle between runs"
                runs[mode] = summary(run_workload(engine, requests))
            else:
                out = event_loop.run(run_http(url, requests, client_processes=args.client_processes))
                if out.failed:
                    raise RuntimeError(f"{out.failed} HTTP request(s) failed: {out.errors}")
                runs[mode] = summary(out.metrics)
        rounds.append({"round": r, "warmup": r < args.warmup_rounds, "seed": args.seed + r,
                       "order": list(runs), **runs, "ratio": runs["http"]["output_throughput"] / runs["offline"]["output_throughput"]})
    return rounds


def render(rounds: list[dict[str, Any]]) -> str:
    lines = ["| round | order | offline s | offline tokens/s | HTTP s | HTTP tokens/s | HTTP / offline | TPOT p50 offline / HTTP (ms) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for x in rounds:
        o, h = x["offline"], x["http"]
        tpot = f"{o['tpot_p50_ms'] or 0:.1f} / {h['tpot_p50_ms'] or 0:.1f}"
        lines.append(f"| {x['round']}{' (warm-up)' if x['warmup'] else ''} | {' -> '.join(x['order'])} | {o['duration_s']:.2f} | "
                     f"{o['output_throughput']:,.0f} | {h['duration_s']:.2f} | {h['output_throughput']:,.0f} | {x['ratio']:.1%} | {tpot} |")
    lines += ["", "| round | run | " + " | ".join(f"{name} p50 / p90 / p99 (ms)" for _, name in LATENCIES) + " |",
              "| --- | --- |" + " --- |" * len(LATENCIES)]
    for x in rounds:
        if not x["warmup"]:
            for mode in x["order"]:
                cells = [" / ".join(f"{(x[mode].get(key) or {}).get(p) or 0:,.1f}" for p in ("p50", "p90", "p99"))
                         for key, _ in LATENCIES]
                lines.append(f"| {x['round']} | {mode} | " + " | ".join(cells) + " |")
    counted = [x["ratio"] for x in rounds if not x["warmup"]]
    lines.append(f"\nmedian HTTP / offline over {len(counted)} round(s): {statistics.median(counted):.1%}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--input-len", type=parse_range, default=(64, 1024), metavar="LOW-HIGH")
    p.add_argument("--output-len", type=parse_range, default=(64, 512), metavar="LOW-HIGH")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=4, help="counted rounds (default 4: an even count runs each order as often)")
    p.add_argument("--warmup-rounds", type=int, default=1, help="rounds run first and not counted (default 1)")
    p.add_argument("--server-memory", type=float, default=0.45,
                   help="the server's gpu_memory_utilization; the offline engine gets the rest of the default 0.9 (default 0.45)")
    p.add_argument("--api-server-count", type=int, default=1,
                   help="the server's API server processes (ingot serve --api-server-count; default 1)")
    p.add_argument("--client-processes", type=int, default=4,
                   help="HTTP client processes, the requests dealt round-robin (default 4): one reads about 28,000 "
                        "streamed chunks/s, and past that the client, not the server, sets the latencies measured")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup_rounds < 0:
        p.error("--rounds must be at least 1 and --warmup-rounds at least 0")
    if args.client_processes < 1:
        p.error("--client-processes must be at least 1")

    server = ServerProcess(args, args.server_memory, args.startup_timeout)
    engine = None
    try:
        engine = build_offline_engine(args)
        warm_up(engine)
        freeze_heap()  # as the server's processes do once started
        rounds = run_rounds(args, engine, server.url)
        env = env_info()
    finally:
        server.stop()
        unfreeze_heap()
        del engine
    print(render(rounds))
    doc = {"workload": {"num_requests": args.num_requests, "input_len": list(args.input_len),
                        "output_len": list(args.output_len), "seed": args.seed},
           "model": model_args(args), "server_memory": args.server_memory, "api_server_count": args.api_server_count,
           "client_processes": args.client_processes, "environment": env,
           "median_ratio": statistics.median(x["ratio"] for x in rounds if not x["warmup"]), "rounds": rounds}
    if args.json:
        write_json(args.json, doc)
    return doc


if __name__ == "__main__":
    main()
