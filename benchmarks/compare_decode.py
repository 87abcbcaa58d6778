"""Graph-replayed decode step time of several ingot checkouts, measured in one interleaved run.

    python -m benchmarks.compare_decode --checkouts /path/to/base,/path/to/branch \\
        [--shapes qwen2.5-1.5b,qwen2.5-7b] [--batches 1,64] [--rounds 3] [--out PATH]

For a change that must not move performance: each round runs, for every shape
and then every checkout, ``python -m ingot bench decode --decode-compile off``
in that checkout's directory (so its own ``ingot`` package is imported; the
checkouts share this Python environment) and reads the graph mode's median ms
per step from its JSON. Rounds interleave the checkouts, so a shared GPU's
slow stretches hit them alike; each checkout's figure is its median over the
rounds, and its ratio to the first checkout is printed with the spread of
the rounds. Uses only long-standing options of ``ingot bench decode``
(``--shape --batch-sizes --decode-compile --iters --quiet --json``), so older
checkouts can be compared too. Needs CUDA; writes JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ingot.bench.report import env_info, write_json

ROOT = Path(__file__).resolve().parents[1]


def graph_ms(checkout: Path, shape: str, batches: list[int], iters: int) -> dict[int, float]:
    """{batch: graph ms per step} from one ``ingot bench decode`` run of ``checkout``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "decode.json"
        cmd = [sys.executable, "-m", "ingot", "bench", "decode", "--shape", shape,
               "--batch-sizes", ",".join(map(str, batches)), "--decode-compile", "off",
               "--iters", str(iters), "--quiet", "--json", str(out)]
        res = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True)
        if res.returncode != 0:
            print(res.stdout[-2000:], res.stderr[-3000:], sep="\n", file=sys.stderr)
            raise SystemExit(f"ingot bench decode failed in {checkout}")
        data = json.loads(out.read_text())
    return {row["batch"]: row["ms"]["graph"] for row in data["timings"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkouts", required=True,
                    help="comma-separated ingot checkouts (repository roots); ratios are against the first")
    ap.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-7b", help="random-weight model shapes")
    ap.add_argument("--batches", default="1,64", help="decode batch sizes")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved passes over the checkouts (default 3)")
    ap.add_argument("--iters", type=int, default=30, help="timed steps per run (default 30)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/compare_decode-<date>.json)")
    args = ap.parse_args()
    checkouts = [Path(c).resolve() for c in args.checkouts.split(",") if c]
    for c in checkouts:
        if not (c / "ingot" / "__init__.py").is_file():
            sys.exit(f"{c} is not an ingot checkout (no ingot/__init__.py)")
    shapes = [s for s in args.shapes.split(",") if s]
    batches = [int(b) for b in args.batches.split(",")]

    runs: dict[tuple[str, str, int], list[float]] = {}
    for r in range(args.rounds):
        for shape in shapes:
            for c in checkouts:
                for batch, ms in graph_ms(c, shape, batches, args.iters).items():
                    runs.setdefault((str(c), shape, batch), []).append(ms)
                    print(f"round {r} {shape:>13} batch {batch:>4} {c}: {ms:.3f} ms", flush=True)

    rows = []
    print(f"\ngraph ms per decode step, median of {args.rounds} rounds (min-max)")
    for shape in shapes:
        for batch in batches:
            base = statistics.median(runs[(str(checkouts[0]), shape, batch)])
            for c in checkouts:
                ms = runs[(str(c), shape, batch)]
                med = statistics.median(ms)
                rows.append(dict(checkout=str(c), shape=shape, batch=batch, ms=med, runs=ms, ratio_to_first=med / base))
                print(f"{shape:>13} batch {batch:>4} {med:8.3f} ({min(ms):.3f}-{max(ms):.3f})  "
                      f"x{med / base:.3f}  {c}")
    report = {"env": env_info(), "iters": args.iters, "rounds": args.rounds, "rows": rows}
    out = args.out or ROOT / "benchmarks" / "results" / f"compare_decode-{dt.date.today()}.json"
    print(f"wrote {write_json(out, report)}")


if __name__ == "__main__":
    main()
