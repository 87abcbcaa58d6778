"""N-gram speculation replayed over greedy outputs: which ``num_speculative_tokens`` and lookup
sizes pay on a workload, without a GPU.

    python -m benchmarks.ngram_replay [--workload copy] [--num-requests 16] [--input-len 512]
        [--output-len 256] [--k 4,8] [--lookup 2-5,1-8] [--plain-ms 1.25] [--verify-ms 1.8] [--json X]

Greedy speculation emits plain greedy decoding's tokens, so one plain greedy run of the
workload (the model on this machine's CPU; the default model unless ``--model``) fixes every
request's output, and the engine's own ``Speculator`` (proposals, per-sequence backoff) is
replayed over it for each setting, one sequence at a time (batch 1): per step it proposes,
and a draft keeps its longest prefix that the output continues with. Each setting's steps
are then counted in three kinds and priced:

* a plain step behind a backoff (no lookup: overlap scheduling hides the host), ``--plain-ms``;
* a verify step (drafts found), ``--verify-ms``;
* a plain step after a lookup that found nothing (the step before was read back first to
  look up its token, so it ran without overlap), priced as a verify step;

a plain step whose lookup could not succeed whatever its pending token
(``NgramIndex.may_follow``) is not read back: a backoff step's price.

The default prices are the default model's (Q4_1) on an H100 at batch 1 (2026-12-07: 1.25 ms
a plain step measured; 1.8 ms a step without overlap, the value that makes this replay's
k=4, lookup 2-5 copy run take the 2.72 s measured with speculation). Prints the predicted
speed-up of each setting over plain decoding; ``ingot bench serve --compare-speculative``
measures it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from ingot import LLM, SamplingParams
from ingot.bench.workload import Workload, make_requests, parse_range
from ingot.config import SpeculativeConfig
from ingot.engine.sequence import Sequence, Status
from ingot.engine.speculative import Speculator


@dataclass
class Replay:
    """One setting's steps over the whole workload, and its predicted speed-up."""

    k: int
    lookup: str
    verify_steps: int = 0
    failed_lookups: int = 0
    backoff_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    predicted_speedup: float = 0.0


def replay(outputs: list[tuple[list[int], list[int]]], k: int, lo: int, hi: int) -> Replay:
    """The engine's speculator over each (prompt, greedy output), one request at a time."""
    result = Replay(k, f"{lo}-{hi}")
    for prompt, out in outputs:
        speculator = Speculator(SpeculativeConfig("ngram", k, lo, hi), max_model_len=1 << 20)
        seq = Sequence("r", None, prompt, SamplingParams(max_tokens=len(out), ignore_eos=True), None)  # type: ignore[arg-type]
        seq.status = Status.RUNNING
        seq.output_token_ids = out[:1]  # the prefill's token
        seq.num_computed_tokens = len(prompt)
        pending = False  # the last token still on the device (overlap scheduling, after a plain step)
        while len(seq.output_token_ids) < len(out):
            n = len(seq.output_token_ids)
            if pending:
                seq.output_token_ids, seq.num_pending = out[: n - 1], 1
            wanted = speculator.wanted([seq])
            seq.output_token_ids, seq.num_pending = out[:n], 0
            speculator.propose([seq], wanted)
            draft = seq.draft_token_ids
            kept = 0
            while kept < len(draft) and draft[kept] == out[n + kept]:
                kept += 1
            if draft:
                seq.spec.record(len(draft), kept)  # type: ignore[union-attr]  # as Speculator.finish does
                result.verify_steps += 1
                result.drafted += len(draft)
                result.accepted += kept
            elif wanted:
                result.failed_lookups += 1
            else:
                result.backoff_steps += 1
            seq.output_token_ids = out[: n + kept + 1]
            seq.num_computed_tokens += kept + 1
            pending = not draft
        result.tokens += len(out)
    return result


def greedy_outputs(args: argparse.Namespace) -> list[tuple[list[int], list[int]]]:
    workload = Workload(args.num_requests, args.input_len, args.output_len, seed=args.seed, kind=args.workload)
    with LLM(args.model, device="cpu", show_progress=False) as llm:
        requests = make_requests(workload, llm.engine.model_config.vocab_size, llm.get_tokenizer())
        outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests],
                            [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests],
                            use_tqdm=False)
    return [(r.prompt_token_ids, list(o.outputs[0].token_ids)) for r, o in zip(requests, outs)]


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--workload", choices=["copy", "random"], default="copy")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", type=parse_range, default=(512, 512), metavar="LOW-HIGH")
    p.add_argument("--output-len", type=parse_range, default=(256, 256), metavar="LOW-HIGH")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k", default="4,8", help="comma-separated num_speculative_tokens")
    p.add_argument("--lookup", default="2-5,1-8", help="comma-separated prompt_lookup_min-max")
    p.add_argument("--plain-ms", type=float, default=1.25, help="a plain step under overlap scheduling")
    p.add_argument("--verify-ms", type=float, default=1.8, help="a verify step, or a plain step after a read-back")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    outputs = greedy_outputs(args)
    rows = []
    for k in (int(x) for x in args.k.split(",")):
        for lo, hi in (parse_range(x) for x in args.lookup.split(",")):
            r = replay(outputs, k, lo, hi)
            ms = (r.verify_steps + r.failed_lookups) * args.verify_ms + r.backoff_steps * args.plain_ms
            r.predicted_speedup = r.tokens * args.plain_ms / ms
            rows.append(r)
    print("| k | lookup | verify steps | failed lookups | backoff steps | acceptance | predicted speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r.k} | {r.lookup} | {r.verify_steps} | {r.failed_lookups} | {r.backoff_steps} | "
              f"{r.accepted / max(r.drafted, 1):.1%} | {r.predicted_speedup:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "rows": [asdict(r) for r in rows]}, indent=1, default=str))


if __name__ == "__main__":
    main()
