"""Host cost of the n-gram proposer per engine step (no model, no GPU).

    python -m benchmarks.ngram_proposer [--batch 64] [--context 4096] [--steps 200] [--k 4] [--min 2] [--max 5]

``Speculator.propose`` over ``--batch`` running sequences of ``--context``-token histories,
each gaining one token per step (the incremental index update included), for three kinds
of history: random ids from a 49,152-token vocabulary (a lookup finds nothing), Zipf-like
ids (short suffixes recur, long ones rarely: several searches per sequence) and a text
that repeats (the longest suffix matches). Backoff is disabled, so every sequence looks up
every step (the worst case). Prints the median milliseconds per step and per sequence.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ingot.config import SpeculativeConfig
from ingot.engine.sequence import Sequence, Status
from ingot.engine.speculative import Speculator
from ingot.sampling_params import SamplingParams

VOCAB = 49152


def histories(kind: str, batch: int, length: int, rng: np.random.Generator) -> list[list[int]]:
    if kind == "random":
        return rng.integers(0, VOCAB, size=(batch, length)).tolist()
    if kind == "zipf":
        return np.minimum(rng.zipf(1.3, size=(batch, length)), VOCAB - 1).tolist()
    period = rng.integers(0, VOCAB, size=(batch, 97))
    return np.tile(period, (1, length // 97 + 1))[:, :length].tolist()


def measure(kind: str, args: argparse.Namespace) -> list[float]:
    rng = np.random.default_rng(0)
    spec = SpeculativeConfig("ngram", args.k, args.min, args.max, disable_by_batch_size=args.batch)
    speculator = Speculator(spec, max_model_len=1 << 20)
    seqs = []
    for tokens in histories(kind, args.batch, args.context + args.steps, rng):
        seq = Sequence("r", None, tokens[: args.context - 1], SamplingParams(max_tokens=None), None)  # type: ignore[arg-type]
        seq.output_token_ids = [tokens[args.context - 1]]
        seq.status = Status.RUNNING
        seq.num_computed_tokens = args.context - 1
        seq.future = tokens[args.context :]  # type: ignore[attr-defined]
        seqs.append(seq)
    speculator.propose(seqs, True)  # the first step indexes the whole history
    times = []
    for step in range(args.steps):
        for seq in seqs:
            seq.output_token_ids.append(seq.future[step])  # type: ignore[attr-defined]
            seq.num_computed_tokens += 1
            seq.spec.skip = 0  # type: ignore[union-attr]
        start = time.perf_counter()
        speculator.propose(seqs, True)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--min", type=int, default=2)
    p.add_argument("--max", type=int, default=5)
    args = p.parse_args()
    print(f"batch {args.batch}, {args.context}-token contexts, k={args.k}, lookup {args.min}..{args.max}")
    for kind in ("random", "zipf", "repeating"):
        ms = statistics.median(measure(kind, args))
        print(f"{kind:>10}: {ms:.3f} ms per step, {1e3 * ms / args.batch:.1f} us per sequence")


if __name__ == "__main__":
    main()
