"""The steps a serving workload becomes under ingot's scheduler, and the host time of scheduling it.

    python -m benchmarks.schedule_mix [--num-requests 512] [--input-len 64-1024] [--output-len 64-512]
                                      [--max-num-seqs 256] [--max-num-batched-tokens 4096] [--out PATH]

No model: every scheduled sequence is computed at once and samples a token; the
KV pool is large enough for every request (the H200's case), so nothing is
preempted. What it shows does not depend on the device: how many prefill steps
interrupt decoding and how small they are (each one stalls the whole decode
batch), how full the decode batches are, and what the scheduler and block
manager cost on the host for the whole run, with prefix caching on and off, for
each ``prefill_wave_tokens`` value given.
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from pathlib import Path
from typing import Any

from ingot.bench.report import env_info, write_json
from ingot.bench.workload import Workload, make_requests, parse_range
from ingot.engine.block_manager import BlockManager
from ingot.engine.scheduler import Scheduler
from ingot.engine.sequence import Sequence, Status
from ingot.sampling_params import SamplingParams

BLOCK_SIZE = 16
SMALL_PREFILL = 1024  # tokens: a prefill step this small is launch-bound on a GPU, not compute-bound


def simulate(workload: Workload, max_num_seqs: int, max_num_batched_tokens: int, prefix_caching: bool,
             vocab_size: int = 151936, prefill_wave_tokens: int = 0) -> dict[str, Any]:
    """Run ``workload`` (all requests at once) through the scheduler; its step mix and host time."""
    reqs = make_requests(workload, vocab_size)
    blocks = sum(-(-(len(r.prompt_token_ids) + r.output_len) // BLOCK_SIZE) for r in reqs) + 1
    sched = Scheduler(BlockManager(blocks, BLOCK_SIZE, prefix_caching), max_num_seqs, max_num_batched_tokens,
                      prefill_wave_tokens)
    for i, r in enumerate(reqs):
        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True)
        sched.add(Sequence(str(i), None, list(r.prompt_token_ids), params, detok=None))
    prefill_sizes: list[int] = []
    decode_sizes: list[int] = []
    start = time.perf_counter()
    while sched.has_work():
        batch = sched.schedule()
        samples = [batch.samples(i) for i in range(len(batch.seqs))]
        computed = sched.on_step_launched(batch)
        (prefill_sizes if batch.is_prefill else decode_sizes).append(
            sum(batch.num_new_tokens) if batch.is_prefill else len(batch.seqs))
        sched.on_step_done(batch, computed)
        for seq, sampled in zip(batch.seqs, samples):
            if sampled and seq.status is Status.RUNNING:
                seq.output_token_ids.append(1)
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    sched.finish(seq)
    host_s = time.perf_counter() - start
    return {
        "prefix_caching": prefix_caching,
        "prefill_wave_tokens": prefill_wave_tokens,
        "prefill_steps": len(prefill_sizes),
        "small_prefill_steps": sum(1 for n in prefill_sizes if n < SMALL_PREFILL),
        "prefill_tokens": sum(prefill_sizes),
        "decode_steps": len(decode_sizes),
        "mean_decode_batch": sum(decode_sizes) / len(decode_sizes) if decode_sizes else None,
        "decode_steps_under_64": sum(1 for n in decode_sizes if n < 64),
        "host_s": host_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--input-len", type=parse_range, default=(64, 1024), metavar="LOW-HIGH")
    ap.add_argument("--output-len", type=parse_range, default=(64, 512), metavar="LOW-HIGH")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--prefill-wave-tokens", default="0,2048", help="EngineConfig.prefill_wave_tokens values to compare")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    workload = Workload(args.num_requests, args.input_len, args.output_len)
    rows = [simulate(workload, args.max_num_seqs, args.max_num_batched_tokens, caching, prefill_wave_tokens=int(wave))
            for wave in args.prefill_wave_tokens.split(",") for caching in (True, False)]
    cols = ["prefill_wave_tokens", "prefill_steps", "small_prefill_steps", "prefill_tokens", "decode_steps", "mean_decode_batch",
            "decode_steps_under_64", "host_s"]
    print(f"{args.num_requests} requests, input {args.input_len}, output {args.output_len}, max_num_seqs "
          f"{args.max_num_seqs}, {args.max_num_batched_tokens} batched tokens (small prefill: < {SMALL_PREFILL} tokens)")
    print(f"{'prefix caching':>15} " + " ".join(f"{c:>22}" for c in cols))
    for r in rows:
        cells = [f"{r[c]:>22.3f}" if isinstance(r[c], float) else f"{r[c]:>22}" for c in cols]
        print(f"{'on' if r['prefix_caching'] else 'off':>15} " + " ".join(cells))
    out = args.out or Path(__file__).parent / "results" / f"schedule_mix-{dt.date.today()}.json"
    print(f"wrote {write_json(out, {'env': env_info(), 'workload': vars(args) | {'out': None}, 'rows': rows})}")


if __name__ == "__main__":
    main()
