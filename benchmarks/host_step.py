"""Host time of one engine decode step (everything but the model), CPU only.

    python -m benchmarks.host_step [--batches 1,64,256] [--steps 100] [--out PATH]
    python -m benchmarks.host_step --json-schema benchmarks/schemas/order-20-properties.json --batches 64

The engine serves ``batch`` greedy requests (64-token prompts, no EOS) over a
one-layer model whose logits are replaced by a fixed tensor, so what is left
is the host work a GPU step waits for: scheduling, building the step inputs,
sampling bookkeeping, appending tokens and stop checks. The engine runs host
and GPU work one after the other, so at batch 256 this adds directly to the
3.5 ms of a 1.5B-shaped step on the H200. Median over ``steps`` decode steps,
split by phase; prints a table, writes JSON.

``--json-schema FILE``: structured outputs. The model's vocabulary is the default
model tokenizer's (49152) and the requests sample greedily from random logits
(a fresh offset into a random table each step, copied: the mask writes into
them), so under the grammar's mask each row takes a random walk through the
schema. Each batch runs twice, with the schema and without; the
phases add the token mask (with its wait for the previous step's tokens), the
matchers' ``advance`` and the bitmask ``fill`` where the engine's loop runs them,
and ``ahead job``: the time of the ahead thread (``--ahead on``, as on CUDA), which
reads a step back, advances its matchers and fills the next step's rows while the
loop goes on. ``forward`` and ``sampler`` (the mask's unpacking, the argmax)
stand in for device work on CPU: ``host`` is the loop's time without them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from ingot.bench.report import env_info, write_json
from ingot.config import EngineConfig, SpeculativeConfig
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


WARMUP_STEPS = 5


def _timed_steps(engine: Engine, steps: int, phase: dict[str, float], warmup: int = WARMUP_STEPS) -> Iterator[float]:
    """Each counted step's wall time, after ``warmup`` uncounted ones; ``phase`` cleared before each step."""
    for i in range(steps + warmup):
        phase.clear()
        t0 = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t0
        if i >= warmup:
            yield total


def tiny_engine(batch: int, max_len: int, tokenizer: Optional[str] = None,
                speculative_config: Optional[SpeculativeConfig] = None) -> Engine:
    """An engine over ``TINY`` with random weights: a config.json alone (token-id words as its
    tokenizer), or with ``tokenizer``'s and its vocabulary; speculating with ``speculative_config``."""
    config = dict(TINY)
    if tokenizer is not None:
        from ingot.loading.checkpoint import open_tokenizer

        config["vocab_size"] = open_tokenizer(tokenizer).vocab_size
    with tempfile.TemporaryDirectory(prefix="ingot-host-step-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        return Engine(EngineConfig(model=tmp, tokenizer=tokenizer, load_format="dummy", device="cpu", dtype="float32",
                                   max_num_seqs=batch, max_model_len=max_len,
                                   num_kv_blocks=batch * (max_len // 16 + 2) + 8, show_progress=False,
                                   speculative_config=speculative_config))


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
    for total in _timed_steps(engine, steps, phase):
        totals["total"].append(total)
        for k in ("schedule", "step inputs", "sampler"):
            totals[k].append(phase[k])
        totals["append, stop checks, rest"].append(total - sum(phase.values()))
    return {k: 1e3 * statistics.median(v) for k, v in totals.items()}


GRAMMAR_PHASES = ["total", "host", "schedule", "step inputs", "token mask", "advance", "fill", "forward", "sampler",
                  "rest", "ahead job"]


def _timed_by_thread(times: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """As ``_timed``; time spent outside the engine's thread goes to ``"ahead: " + name``."""
    loop = threading.get_ident()

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            key = name if threading.get_ident() == loop else "ahead: " + name
            times[key] += time.perf_counter() - t0
    return wrapper


def measure_grammar(batch: int, steps: int, schema: Any, ahead: bool, prompt_len: int = 64) -> dict[str, float]:
    """Host ms per decode step of ``batch`` requests under ``schema`` (None: unconstrained),
    split by phase (module docstring). ``ahead``: the grammar work of a step in flight in
    the engine's ahead thread, as on CUDA; ``ahead job`` is that thread's time per step."""
    from ingot.engine import engine as engine_module
    from ingot.sampling_params import StructuredOutputsParams

    torch.manual_seed(0)
    engine = tiny_engine(batch, prompt_len + steps + 40, tokenizer="default")
    engine.grammars.ahead = ahead
    runner = engine.executor
    vocab = engine.model_config.vocab_size
    so = StructuredOutputsParams(json=schema) if schema is not None else None
    params = SamplingParams(temperature=0.0, max_tokens=steps + 20, ignore_eos=so is None, structured_outputs=so)
    for i in range(batch):
        engine.add_request([(7 * i + j) % 1000 + 100 for j in range(prompt_len)], params, str(i), stream=False)
    while engine.grammars.num_held or engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()  # compile, prefill
    table = torch.randn(batch, 2 * vocab)
    offsets = iter(torch.randint(0, vocab, (steps + 10,)).tolist())
    runner.forward_logits = lambda inputs: table[: inputs.num_seqs, (o := next(offsets)) : o + vocab].clone()

    phase: dict[str, float] = defaultdict(float)
    wrapped = {"schedule": (engine.scheduler, "schedule"), "step inputs": (model_runner, "build_step_inputs"),
               "forward": (runner, "forward_logits"), "sampler": (runner.sampler, "sample"),
               "token mask": (engine.grammars, "token_mask"), "fill": (engine.grammars, "_fill"),
               "advance": (engine_module, "advance")}
    job = getattr(engine_module._InFlight, "_advance_and_fill", None)  # (absent where there is no ahead thread)
    if job is not None:
        wrapped["job"] = (engine_module._InFlight, "_advance_and_fill")
    originals = [(obj, name, getattr(obj, name)) for obj, name in wrapped.values()]
    for label, (obj, name) in wrapped.items():
        setattr(obj, name, _timed_by_thread(phase, label, getattr(obj, name)))
    totals: dict[str, list[float]] = defaultdict(list)
    rows = []
    try:
        for total in _timed_steps(engine, steps, phase):
            outer = ("schedule", "step inputs", "forward", "sampler", "token mask")
            totals["total"].append(total)
            totals["host"].append(total - phase["forward"] - phase["sampler"])
            for k in ("schedule", "step inputs", "token mask", "advance", "fill", "forward", "sampler"):
                totals[k].append(phase[k])
            # in the loop: advance runs inside the token mask's wait, or at read-back when no mask waited
            inside = phase["advance"] if phase["token mask"] else 0.0
            totals["rest"].append(total - sum(phase[k] for k in outer) - (phase["advance"] - inside))
            totals["ahead job"].append(phase["ahead: job"])
            # (no matcher call here: the ahead thread may be running)
            rows.append(sum(1 for s in engine.scheduler.running if s.grammar is not None))
    finally:
        for obj, name, fn in originals:
            setattr(obj, name, fn)
        engine.close()
    out = {k: 1e3 * statistics.median(v) for k, v in totals.items()}
    out["grammar rows"] = statistics.median(rows)
    return out


def report(title: str, rows: list[dict[str, Any]], keys: dict[str, int], cols: list[str], width: int,
           out: Optional[str], name: str, meta: dict[str, Any], formats: Optional[dict[str, str]] = None) -> None:
    """Print ``rows`` as a table (the ``keys`` columns at their widths, then ``cols`` as numbers,
    ``.3f`` unless ``formats`` says otherwise) and write them with ``meta`` and the environment
    as JSON (default ``benchmarks/results/<name>-<date>.json``)."""
    fmt = formats or {}
    print(title)
    print(" ".join(f"{k:>{w}}" for k, w in keys.items()) + " " + " ".join(f"{c:>{width}}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[k]:>{w}}" for k, w in keys.items()) + " "
              + " ".join(f"{r[c]:>{width}{fmt.get(c, '.3f')}}" for c in cols))
    path = out or Path(__file__).parent / "results" / f"{name}-{dt.date.today()}.json"
    print(f"wrote {write_json(path, {'env': env_info(), **meta, 'rows': rows})}")


def main_grammar(args: argparse.Namespace) -> None:
    schema = json.loads(Path(args.json_schema).read_text())
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        for name, spec in (("none", None), (Path(args.json_schema).name, schema)):
            rows.append(dict(batch=b, schema=name, ahead=args.ahead,
                             **measure_grammar(b, args.steps, spec, args.ahead == "on")))
    report(f"host ms per decode step (median of {args.steps}), ahead thread {args.ahead}; "
           "forward and sampler stand in for device work", rows, {"batch": 6, "schema": 26},
           GRAMMAR_PHASES + ["grammar rows"], 12, args.out, "host_step-structured",
           {"steps": args.steps, "json_schema": args.json_schema}, {"grammar rows": ".0f"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--stream", action="store_true",
                    help="requests read every step's output (a server's streams) instead of only the last")
    ap.add_argument("--json-schema", default=None, help="structured outputs: requests under this JSON schema "
                    "(and the same batch without), the default model tokenizer's vocabulary")
    ap.add_argument("--ahead", choices=("on", "off"), default="on",
                    help="with --json-schema: a step's grammar work in the engine's ahead thread (as on CUDA) or in its loop")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.json_schema is not None:
        main_grammar(args)
        return
    original = model_runner.build_step_inputs
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        ms = measure(b, args.steps, stream=args.stream)
        model_runner.build_step_inputs = original
        rows.append(dict(batch=b, **ms))
    cols = ["total", "schedule", "step inputs", "sampler", "append, stop checks, rest"]
    report(f"host ms per decode step (median of {args.steps})", rows, {"batch": 6}, cols, 26, args.out, "host_step",
           {"steps": args.steps})


if __name__ == "__main__":
    main()
