"""Host time of speculative decoding's verify steps against plain decode steps, CPU only.

    python -m benchmarks.host_step_spec [--batches 1,8] [--k 4] [--steps 200] [--out PATH]

A verify step is read back before the next step is scheduled (its tokens decide the next
drafts), so on a GPU its host work is not hidden behind the device as a plain step's is:
it adds to every round. Here the engine (``benchmarks.host_step.tiny_engine``: a one-layer
model) serves ``batch`` greedy requests whose logits are replaced by a table that continues
a cycle of 24 tokens, so every n-gram draft (``k`` tokens, lookups of 2-5) is kept and each
verify step emits ``k + 1`` tokens. Per step and per output token, the median host time,
split by phase: ``propose`` (the n-gram lookups), ``schedule``, ``step inputs``, ``forward``
(the table lookup standing in for the device), ``verify`` (the drafts against the argmax:
device work on a GPU), ``read back`` (rolling back, the tokens through the stop rules one
position at a time) and the rest; the same engine without speculation beside it. Prints a
table, writes JSON (default ``benchmarks/results/host_step_spec-<date>.json``).
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from typing import Any, Optional

import torch

from benchmarks.host_step import VOCAB, WARMUP_STEPS, _timed, _timed_steps, report, tiny_engine
from ingot.config import SpeculativeConfig
from ingot.runner import model_runner
from ingot.sampling_params import SamplingParams

CYCLE = list(range(5, 29))  # the requests' text: this cycle, again and again
PHASES = ["total", "propose", "schedule", "step inputs", "forward", "verify", "read back", "rest"]


def _cycle_logits() -> torch.Tensor:
    """[VOCAB, VOCAB]: row t puts its largest logit on the token after t in ``CYCLE``."""
    nxt = torch.full((VOCAB,), CYCLE[0], dtype=torch.int64)
    for i, t in enumerate(CYCLE):
        nxt[t] = CYCLE[(i + 1) % len(CYCLE)]
    return 10.0 * torch.nn.functional.one_hot(nxt, VOCAB).float()


def measure(batch: int, steps: int, k: Optional[int]) -> dict[str, Any]:
    """Median host ms per step and per output token, by phase; ``k`` None: no speculation."""
    torch.manual_seed(0)
    spec = None if k is None else SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    engine = tiny_engine(batch, 4 * len(CYCLE) + (steps + 10) * ((k or 0) + 1) + 40, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=(steps + 10) * ((k or 0) + 1), ignore_eos=True)
    for i in range(batch):
        engine.add_request(CYCLE * 4, params, str(i))
    while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()  # prefill
    table = _cycle_logits()
    runner = engine.executor
    assert isinstance(runner, model_runner.ModelRunner), "one process: the engine's executor is its ModelRunner"
    phase: dict[str, float] = defaultdict(float)
    runner.forward_logits = _timed(phase, "forward", lambda inputs: table[inputs.input_ids[inputs.logits_indices]])
    engine.scheduler.schedule = _timed(phase, "schedule", engine.scheduler.schedule)
    originals = (model_runner.build_step_inputs, model_runner.verify_drafts)
    model_runner.build_step_inputs = _timed(phase, "step inputs", model_runner.build_step_inputs)
    if engine.spec is not None:
        sp = engine.spec
        sp.propose = _timed(phase, "propose", sp.propose)
        sp.finish = _timed(phase, "read back", sp.finish)
        model_runner.verify_drafts = _timed(phase, "verify", model_runner.verify_drafts)
    totals: dict[str, list[float]] = defaultdict(list)
    before = engine.stats().generation_tokens
    try:
        for total in _timed_steps(engine, steps, phase):
            totals["total"].append(total)
            for name in PHASES[1:-1]:
                totals[name].append(phase.get(name, 0.0))
            totals["rest"].append(total - sum(phase.values()))
    finally:
        model_runner.build_step_inputs, model_runner.verify_drafts = originals
    tokens = (engine.stats().generation_tokens - before) / (steps + WARMUP_STEPS)  # per step, warm-up included
    row: dict[str, Any] = {name: 1e3 * statistics.median(v) for name, v in totals.items()}
    row["tokens per step"] = tokens
    row["total per token"] = row["total"] / tokens
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        for k in (None, args.k):
            rows.append(dict(batch=b, k=k or 0, **measure(b, args.steps, k)))
    report(f"host ms per step (median of {args.steps}); forward and verify stand in for device work", rows,
           {"batch": 6, "k": 3}, PHASES + ["tokens per step", "total per token"], 12, args.out, "host_step_spec",
           {"steps": args.steps, "k": args.k})


if __name__ == "__main__":
    main()
