"""Host time of one engine decode step (everything but the model), CPU only.

    python -m benchmarks.host_step [--batches 1,64,256] [--steps 100] [--out PATH]

The engine serves ``batch`` greedy requests (64-token prompts, no EOS) over a
one-layer model whose logits are replaced by a fixed tensor, so what is left
is the host work a GPU step waits for: scheduling, building the step inputs,
sampling bookkeeping, appending tokens and stop checks. The engine runs host
and GPU work one after the other, so at batch 256 this adds directly to the
3.5 ms of a 1.5B-shaped step on the H200. Median over ``steps`` decode steps,
split by phase; prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

from ingot.bench.report import env_info, write_json
from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.runner import model_runner
from ingot.sampling_params import SamplingParams

VOCAB = 64  # small: the argmax stands in for a GPU kernel, it must not dominate on CPU
TINY = dict(architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=4096,
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)


def _timed(times: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[name] += time.perf_counter() - t0
    return wrapper


def tiny_engine(batch: int, max_len: int) -> Engine:
    """An engine over ``TINY`` with random weights (a config.json alone: token-id words as its tokenizer)."""
    with tempfile.TemporaryDirectory(prefix="ingot-host-step-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(TINY))
        return Engine(EngineConfig(model=tmp, load_format="dummy", device="cpu", dtype="float32", max_num_seqs=batch,
                                   max_model_len=max_len, num_kv_blocks=batch * (max_len // 16 + 2) + 8,
                                   show_progress=False))


def measure(batch: int, steps: int, prompt_len: int = 64, stream: bool = False) -> dict[str, float]:
    torch.manual_seed(0)
    engine = tiny_engine(batch, prompt_len + steps + 40)
    runner = engine.executor
    assert isinstance(runner, model_runner.ModelRunner), "one process: the engine's executor is its ModelRunner"
    params = SamplingParams(temperature=0.0, max_tokens=steps + 20, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + j) % VOCAB for j in range(prompt_len)], params, str(i), stream=stream)
    while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()  # prefill
    logits = torch.randn(batch, VOCAB)
    runner.forward_logits = lambda inputs: logits[: inputs.num_seqs]

    phase: dict[str, float] = defaultdict(float)
    engine.scheduler.schedule = _timed(phase, "schedule", engine.scheduler.schedule)
    model_runner.build_step_inputs = _timed(phase, "step inputs", model_runner.build_step_inputs)
    runner.sampler.sample = _timed(phase, "sampler", runner.sampler.sample)
    totals: dict[str, list[float]] = defaultdict(list)
    for i in range(steps + 5):
        phase.clear()
        t0 = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t0
        if i < 5:
            continue  # warm-up
        totals["total"].append(total)
        for k in ("schedule", "step inputs", "sampler"):
            totals[k].append(phase[k])
        totals["append, stop checks, rest"].append(total - sum(phase.values()))
    return {k: 1e3 * statistics.median(v) for k, v in totals.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--stream", action="store_true",
                    help="requests read every step's output (a server's streams) instead of only the last")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    original = model_runner.build_step_inputs
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        ms = measure(b, args.steps, stream=args.stream)
        model_runner.build_step_inputs = original
        rows.append(dict(batch=b, **ms))
    cols = ["total", "schedule", "step inputs", "sampler", "append, stop checks, rest"]
    print(f"host ms per decode step (median of {args.steps})")
    print(f"{'batch':>6} " + " ".join(f"{c:>26}" for c in cols))
    for r in rows:
        print(f"{r['batch']:>6} " + " ".join(f"{r[c]:>26.3f}" for c in cols))
    out = args.out or Path(__file__).parent / "results" / f"host_step-{dt.date.today()}.json"
    print(f"wrote {write_json(out, {'env': env_info(), 'steps': args.steps, 'rows': rows})}")


if __name__ == "__main__":
    main()
