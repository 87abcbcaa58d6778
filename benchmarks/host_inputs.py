"""Host time of building a decode step's inputs (``runner/step_inputs.py``), CPU only.

    python -m benchmarks.host_inputs [--batches 1,256] [--out PATH]

Sequences with 600-1,500 cached tokens (block size 16), one new token each;
median of 200 builds after warm-up. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import statistics
import time
from pathlib import Path

import torch

from ingot.bench.report import env_info, write_json
from ingot.runner.batch import ScheduledBatch
from ingot.engine.sequence import Sequence
from ingot.runner.step_inputs import build_step_inputs
from ingot.sampling_params import SamplingParams


def decode_batch(batch: int, rng: random.Random) -> ScheduledBatch:
    seqs = []
    for i in range(batch):
        n = rng.randint(600, 1500)
        seq = Sequence(str(i), None, list(range(n)), SamplingParams(), None)
        seq.output_token_ids = [5]
        seq.block_ids.extend(range(1, n // 16 + 2))
        seq.num_computed_tokens = n
        seqs.append(seq)
    return ScheduledBatch(seqs, False, [1] * batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,256")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    rows = []
    print(f"{'batch':>6} {'build_step_inputs ms':>22}")
    for b in (int(x) for x in args.batches.split(",")):
        batch = decode_batch(b, rng)
        for _ in range(20):
            build_step_inputs(batch, 16, torch.device("cpu"))
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            build_step_inputs(batch, 16, torch.device("cpu"))
            times.append(time.perf_counter() - t0)
        ms = 1e3 * statistics.median(times)
        rows.append(dict(batch=b, build_step_inputs_ms=ms))
        print(f"{b:>6} {ms:>22.3f}")
    out = write_json(args.out or Path(__file__).parent / "results" / f"host_inputs-{dt.date.today()}.json",
                     {"env": env_info(), "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
