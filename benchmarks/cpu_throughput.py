"""CPU generation throughput of the default model (SmolLM2-135M, fp32, greedy).

    python -m benchmarks.cpu_throughput [--batches 1,16] [--max-tokens 64] [--out PATH]

``LLM.generate`` of one prompt per row, every request running to
``max-tokens`` (EOS ignored), after a short warm-up; output tokens per second
of wall-clock time. Prints a line per batch size and writes JSON (default
benchmarks/results/cpu_throughput-<date>.json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import time
from pathlib import Path

import torch

from ingot import LLM, SamplingParams
from ingot.bench.report import write_json

PROMPT = "The history of the printing press begins"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16", help="comma-separated batch sizes (default 1,16)")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default 64)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/cpu_throughput-<date>.json)")
    args = ap.parse_args()
    llm = LLM(device="cpu", dtype="float32", show_progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = [f"{PROMPT} ({i})" for i in range(b)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        secs = time.perf_counter() - t0
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"batch": b, "output_tokens": toks, "seconds": secs, "tokens_per_s": toks / secs})
        print(f"batch {b:>3}: {toks} tokens in {secs:.2f}s = {toks / secs:.1f} tok/s", flush=True)
    report = {"env": {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                      "machine": platform.machine(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")},
              "model": "SmolLM2-135M-Instruct Q4_1 GGUF, fp32", "max_tokens": args.max_tokens, "rows": rows}
    write_json(args.out or Path(__file__).parent / "results" / f"cpu_throughput-{dt.date.today()}.json", report)


if __name__ == "__main__":
    main()
