"""What a draft model's measured costs predict for draft-model speculation, against what it measures.

    python -m benchmarks.draft_prediction --target-decode T.json --draft-decode D.json \
        --no-overlap P.json [--serve S.json ...] [--batch 1] [--k 4] [--out PATH]

Inputs are the JSON files of ingot's own benchmarks, all from one machine:

* ``--target-decode``: ``ingot bench decode`` of the target with ``--speculative-k`` (the
  plain decode step and the verify step of ``k`` drafts per sequence, graph mode);
* ``--draft-decode``: ``ingot bench decode`` of the draft with ``--speculative-k 1`` (its
  decode step timed with the greedy pick: a draft step is one decode-graph replay and its pick);
* ``--no-overlap``: ``ingot bench serve`` of the target without speculation and with
  ``--no-overlap-scheduling``: its time per output token less the plain step is the host time a
  step costs where it is read back at once, as every verify step is;
* ``--serve``: ``ingot bench serve --compare-speculative`` runs of the draft-model setting.

A round of speculation is ``k`` draft steps, one verify step and that host time; it emits the
kept drafts and one token of the target's. With a per-draft acceptance ``a`` (each draft kept
with probability ``a`` once the ones before it were), a round emits ``(1 - a**(k + 1)) / (1 -
a)`` tokens, so the speed-up over plain decoding is that many tokens times the plain time per
output token, over the round. The plain time per output token is the serve runs' own (mean
TPOT of their plain rounds), or without them the plain step plus nothing. For each ``--serve``
run the prediction at its measured tokens per round (1 + mean accepted length) is set beside
its measured TPOT speed-up. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from ingot.bench.report import write_json

ACCEPTANCES = (0.6, 0.8, 0.9, 1.0)


def decode_run(path: Path, batch: int) -> dict[str, Any]:
    """The bf16 / first run's timing row of ``batch`` in an ``ingot bench decode`` JSON."""
    data = json.loads(path.read_text())
    run = data["runs"][0] if "runs" in data else data
    for row in run["timings"]:
        if row["batch"] == batch:
            return row
    raise SystemExit(f"{path}: no batch {batch} (batches {[r['batch'] for r in run['timings']]})")


def verify_timing(row: dict[str, Any], k: int) -> dict[str, Any]:
    """The graph-mode verify timing of ``k`` drafts (with the plain decode step it was timed against)."""
    for timing in row["speculative"].get("graph", []):
        if timing["k"] == k:
            return timing
    raise SystemExit(f"no graph verify timing for k={k}: run ingot bench decode with --speculative-k {k}")


def serve_rounds(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(plain rounds, speculative rounds) of an ``ingot bench serve`` JSON."""
    results = json.loads(path.read_text())["results"]
    plain = [r for r in results if r.get("speculative") in (None, "plain")]
    spec = [r for r in results if r.get("speculative") not in (None, "plain")]
    return plain, spec


def mean_tpot(rounds: list[dict[str, Any]]) -> float:
    return statistics.mean(r["tpot_ms"]["mean"] for r in rounds)


def tokens_per_round(acceptance: float, k: int) -> float:
    return k + 1.0 if acceptance >= 1.0 else (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def predict(args: argparse.Namespace) -> dict[str, Any]:
    timing = verify_timing(decode_run(args.target_decode, args.batch), args.k)
    plain_step, verify = timing["decode_ms"], timing["verify_ms"]
    draft = decode_run(args.draft_decode, args.batch)["speculative"].get("graph")
    if not draft:
        raise SystemExit(f"{args.draft_decode}: run the draft's ingot bench decode with --speculative-k 1 (its step "
                         "timed with the greedy pick)")
    draft_step = draft[0]["decode_ms"]
    no_overlap_plain, _ = serve_rounds(args.no_overlap)
    host = max(0.0, mean_tpot(no_overlap_plain) - plain_step)
    round_ms = args.k * draft_step + verify + host
    serves = [(p, *serve_rounds(p)) for p in args.serve]
    plain_tpot = statistics.mean(mean_tpot(plain) for _, plain, _ in serves) if serves else plain_step
    costs = dict(plain_step_ms=plain_step, draft_step_ms=draft_step, verify_ms=verify, host_ms=host,
                 round_ms=round_ms, plain_tpot_ms=plain_tpot)
    per_acceptance = {a: tokens_per_round(a, args.k) for a in ACCEPTANCES}
    by_acceptance = [dict(acceptance=a, tokens_per_round=n, speedup=n * plain_tpot / round_ms)
                     for a, n in per_acceptance.items()]
    measured = []
    for path, plain, spec in serves:
        per_round = statistics.mean(1.0 + (r["spec_mean_accepted_length"] or 0.0) for r in spec)
        predicted = per_round * mean_tpot(plain) / round_ms
        actual = mean_tpot(plain) / mean_tpot(spec)
        measured.append(dict(serve=str(path), acceptance=statistics.mean(r["spec_acceptance_rate"] or 0.0 for r in spec),
                             tokens_per_round=per_round, predicted_speedup=predicted, measured_speedup=actual,
                             measured_vs_predicted=actual / predicted))
    return dict(batch=args.batch, k=args.k, costs=costs, by_acceptance=by_acceptance, measured=measured)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-decode", type=Path, required=True)
    ap.add_argument("--draft-decode", type=Path, required=True)
    ap.add_argument("--no-overlap", type=Path, required=True)
    ap.add_argument("--serve", type=Path, nargs="*", default=[])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = predict(args)
    c = result["costs"]
    print(f"batch {args.batch}, k={args.k}: plain step {c['plain_step_ms']:.3f} ms, draft step {c['draft_step_ms']:.3f} ms, "
          f"verify {c['verify_ms']:.3f} ms, host {c['host_ms']:.3f} ms -> round {c['round_ms']:.3f} ms; "
          f"plain TPOT {c['plain_tpot_ms']:.3f} ms")
    print(f"{'acceptance':>10} {'tokens/round':>13} {'predicted':>10}")
    for row in result["by_acceptance"]:
        print(f"{row['acceptance']:>10.0%} {row['tokens_per_round']:>13.2f} {row['speedup']:>9.2f}x")
    for m in result["measured"]:
        print(f"{m['serve']}: acceptance {m['acceptance']:.1%}, {m['tokens_per_round']:.2f} tokens/round: predicted "
              f"{m['predicted_speedup']:.2f}x, measured {m['measured_speedup']:.2f}x ({m['measured_vs_predicted']:.1%})")
    if args.out:
        print(f"wrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()
