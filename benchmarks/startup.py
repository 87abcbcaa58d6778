"""Start-up cost of compiled decode graphs: capture of every bucket, cold then warm caches.

    python -m benchmarks.startup [--shape qwen2.5-1.5b] [--batches 1,8,32,64,256 | --batches all] [--out PATH]

Two fresh processes share a new, empty ``TORCHINDUCTOR_CACHE_DIR`` and
``TRITON_CACHE_DIR``: the first starts cold, the second finds what the first
compiled (the persistent caches a second engine start reuses). Each builds a
random-weight model of the shape and times ``DecodeGraphRunner.capture_all()``
with ``decode_compile`` on: the compile (three compiles with the default
dynamic batch), the warm-up and capture of every bucket. ``--batches all``
takes the engine's default buckets for its default max_num_seqs on this GPU. Needs CUDA; writes JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ingot.bench.decode import decode_engine
from ingot.bench.report import env_info, write_json
from ingot.config import EngineConfig, max_num_seqs_for
from ingot.loading.dummy import SHAPES
from ingot.models.loader import device_memory
from ingot.runner.graph_runner import DecodeGraphRunner, default_buckets
from ingot.runner.kv_pool import blocks_for
from ingot.runner.model_runner import ModelRunner

ROOT = Path(__file__).resolve().parents[1]


def capture_buckets(runner: ModelRunner, context: int) -> dict:
    """Seconds to build a decode graph runner with compile on and capture every bucket of
    ``runner``'s config (its engine captured none: ``decode_engine`` runs it eager)."""
    config = runner.config.replace(eager_mode=False)
    per_seq = blocks_for(context + 1, config.block_size)
    t0 = time.perf_counter()
    graphs = DecodeGraphRunner(runner.model, config, runner.device, per_seq, runner.policy, runner.tp)
    graphs.capture_all()
    total = time.perf_counter() - t0
    return {"capture_all_s": total,
            "per_bucket": {b: [i.seconds_warmup, i.seconds_capture] for b, i in graphs.info.items()}}


def capture_once(shape: str, batches: list[int], context: int) -> dict:
    """``capture_buckets`` on a random-weight bf16 model of ``shape`` (this process)."""
    config = EngineConfig(model=shape, load_format="dummy", device="cuda", dtype="bfloat16", decode_compile=True)
    engine = decode_engine(config, batches, context)
    try:
        return engine.executor.run_on_ranks(capture_buckets, context)
    finally:
        engine.close()


def cold_and_warm(shape: str, batches: list[int], context: int) -> dict:
    cache = Path(tempfile.mkdtemp(prefix="ingot-startup-"))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"))
    cmd = [sys.executable, "-m", "benchmarks.startup", "--child", "--shape", shape,
           "--batches", ",".join(map(str, batches)), "--context", str(context)]
    out = {}
    try:
        for label in ("cold", "warm"):
            res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
            if res.returncode != 0:
                print(res.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"the {label} start-up process failed")
            out[label] = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"{shape} {label}: {len(batches)} compiled buckets captured in {out[label]['capture_all_s']:.1f} s", flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES), help="random-weight model shape")
    ap.add_argument("--batches", default="1,8,32,64,256", help="buckets to capture, or 'all' (the default buckets of this GPU's default max_num_seqs)")
    ap.add_argument("--context", type=int, default=512, help="cached tokens per sequence the block tables hold (default 512)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/startup-<shape>-<date>.json)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("python -m benchmarks.startup needs a CUDA GPU")
    if args.batches == "all":
        batches = default_buckets(max_num_seqs_for(device_memory(torch.device("cuda"))))
    else:
        batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        print(json.dumps(capture_once(args.shape, batches, args.context)))
        return
    report = {"env": env_info(), "shape": args.shape, "batches": batches, "context_len": args.context,
              "startup": cold_and_warm(args.shape, batches, args.context)}
    out = args.out or ROOT / "benchmarks" / "results" / f"startup-{args.shape}-{dt.date.today()}.json"
    print(f"wrote {write_json(out, report)}")


if __name__ == "__main__":
    main()
