"""Host time of detokenizing a decode step, per step and deferred to the end, CPU only.

    python -m benchmarks.detokenize [--batch 256] [--tokens 128] [--out PATH]

``batch`` sequences of the default model's tokenizer (SmolLM2) each get
``tokens`` output tokens (slices of this repository's README), one per step:
once decoded every step as a streaming request needs (``add_tokens``), once
deferred and decoded in one batch when the sequences finish (what
``LLM.generate`` does for requests without stop strings). Median step time;
checks that both give the same texts. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time
from pathlib import Path

from ingot.bench.report import env_info, write_json
from ingot.loading.checkpoint import default_model_path, open_checkpoint
from ingot.loading.tokenizer import IncrementalDetokenizer, add_tokens

ROOT = Path(__file__).resolve().parents[1]


def run(batch: int, tokens: int) -> dict:
    tok = open_checkpoint(str(default_model_path())).tokenizer
    ids = tok.encode((ROOT / "README.md").read_text(), add_special_tokens=False)
    streams = [[ids[(i * 37 + j) % len(ids)] for j in range(tokens)] for i in range(batch)]

    def one(deferred: bool) -> tuple[float, float, list[str]]:
        dets = [IncrementalDetokenizer(tok, ids[:5]) for _ in range(batch)]
        steps = []
        for j in range(tokens):
            t0 = time.perf_counter()
            if deferred:
                for d, s in zip(dets, streams):
                    d.defer([s[j]])
            else:
                add_tokens(dets, [[s[j]] for s in streams])
            steps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        if deferred:
            add_tokens(dets, [[] for _ in dets], final=True)
        final = time.perf_counter() - t0
        return 1e3 * statistics.median(steps), 1e3 * final, [d.text for d in dets]

    every_ms, _, every_texts = one(False)
    deferred_ms, final_ms, deferred_texts = one(True)
    report = dict(env=env_info(), batch=batch, tokens=tokens, per_step_ms=every_ms, deferred_step_ms=deferred_ms,
                  deferred_final_ms=final_ms, deferred_amortized_ms=deferred_ms + final_ms / tokens,
                  same_texts=every_texts == deferred_texts)
    print(f"batch {batch}, {tokens} tokens each")
    print(f"  every step : {every_ms:7.3f} ms per step")
    print(f"  deferred   : {deferred_ms:7.3f} ms per step + {final_ms:.1f} ms once at the end "
          f"({report['deferred_amortized_ms']:.3f} ms per step amortized); same texts: {report['same_texts']}")
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/detokenize-<date>.json)")
    args = ap.parse_args()
    report = run(args.batch, args.tokens)
    out = write_json(args.out or ROOT / "benchmarks" / "results" / f"detokenize-{dt.date.today()}.json", report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
