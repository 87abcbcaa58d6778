"""`ingot bench serve`: end-to-end throughput and latency on a synthetic workload.

For each decode-compile mode: build one engine, run one small warm-up request,
then ``--repeat`` rounds of the workload (see ingot/bench/serve.py), the prefix
cache emptied before every round; the median round is reported. Print a table
and optionally write every number, the workload and the environment as JSON. With ``--url``, the same workload goes
over HTTP to a running OpenAI-compatible server (``ingot serve`` or any other;
see ingot/bench/http_serve.py) instead. With ``--json-schema FILE`` every request's output
is constrained by that JSON schema (structured outputs), and the outputs that do not
validate are counted. With ``--speculative-config`` the engine speculates and the table
adds the acceptance rate and mean accepted length; ``--compare-speculative`` runs every
round plainly and speculating on that one engine (ingot/bench/speculation.py) and reports
the speed-up measured in the run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import logging
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional

from ingot.bench.serve_table import header, render_table, speedup_lines
from ingot.bench.speculation import as_json, describe, speculation_off, speculative_arg, speedup
from ingot.config import DTYPES

log = logging.getLogger(__name__)

# --compile-modes names -> EngineConfig.decode_compile
MODES = {"off": False, "on": True, "auto": "auto"}


def _range_arg(text: str) -> tuple[int, int]:
    from ingot.bench.workload import parse_range

    try:
        return parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rate_arg(text: str) -> float:
    from ingot.bench.workload import parse_rate

    try:
        return parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_arg(text: str) -> int:
    return _int_arg(text, 1, "a positive integer")


def _count_arg(text: str) -> int:
    return _int_arg(text, 0, "a non-negative integer")


def _int_arg(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def _names_arg(choices: dict[str, Any]):
    def parse(text: str) -> list[str]:
        names = [m.strip().lower() for m in text.split(",") if m.strip()]
        bad = [m for m in names if m not in choices]
        if not names or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {'/'.join(choices)}, got {text!r}")
        return list(dict.fromkeys(names))

    return parse


_modes_arg = _names_arg(MODES)


def add_parser(subparsers) -> None:
    # Not add_engine_args: its --decode-compile is an on/off flag, here it picks modes to compare.
    from ingot.engine_args import add_model_args

    p = subparsers.add_parser(
        "serve",
        help="end-to-end throughput and latency (TTFT, ITL) on a synthetic workload",
        description="Send N synthetic requests (random token prompts, lengths drawn uniformly from ranges) "
        "all at once or at a Poisson rate, and report throughput, time to first token and inter-token latency.",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=64, help="number of requests (default 64)")
    w.add_argument("--input-len", type=_range_arg, default=(64, 1024), metavar="LOW-HIGH", help="prompt length range, inclusive (default 64-1024)")
    w.add_argument("--output-len", type=_range_arg, default=(64, 512), metavar="LOW-HIGH", help="output length range, inclusive (default 64-512)")
    w.add_argument("--request-rate", type=_rate_arg, default=float("inf"), metavar="RATE", help="requests/s, Poisson arrivals; inf (default) sends all at once")
    w.add_argument("--seed", type=int, default=0, help="seed of lengths, prompts and arrival times (default 0)")
    w.add_argument("--shared-prefix-len", type=int, default=0, metavar="N",
                   help="every prompt starts with the same N random tokens (a shared system prompt), then its own --input-len tokens (default 0)")
    w.add_argument("--workload", choices=["random", "multi-turn", "copy"], default="random",
                   help="random: independent requests of random token ids (default); multi-turn: --num-requests conversations, "
                        "each turn resends the conversation so far (previous prompt, the model's reply, a new user message of "
                        "--input-len tokens) once the previous turn has finished; copy: prompts of --input-len tokens (chat "
                        "template included) asking to repeat standard-library code or text they hold, as code editing and "
                        "summarising do, where n-gram speculation finds drafts (a --shape needs --tokenizer, e.g. default; "
                        "random weights rarely copy, so acceptance stays low)")
    w.add_argument("--turns", type=_range_arg, default=None, metavar="LOW-HIGH", help="turns per conversation, multi-turn only (default 2-6)")
    w.add_argument("--json-schema", type=Path, default=None, metavar="FILE",
                   help="constrain every request's output to this JSON schema (structured outputs; a request ends when its "
                        "JSON is complete) and count the outputs that do not validate; local engine only")
    g = p.add_argument_group("model and engine")
    add_model_args(g)
    g.add_argument("--dtype", default="auto", choices=DTYPES, help="auto = bf16 on CUDA, fp32 on CPU")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--max-model-len", type=int, default=None, help="context length; default: the model's")
    g.add_argument("--max-num-seqs", type=int, default=None, help="most sequences in one batch (default: the engine's)")
    g.add_argument("--eager", action="store_true", help="no decode CUDA graphs")
    g.add_argument(
        "--compile-modes", "--decode-compile", dest="compile_modes", type=_modes_arg, nargs="?", const=["on"], default=["off"],
        metavar="MODES", help="decode-compile modes to run, comma-separated from off,on,auto (default off; alone: on). Compile only applies on CUDA",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="recompute every prompt (no automatic prefix caching)")
    g.add_argument("--no-overlap-scheduling", action="store_true",
                   help="read each step back before queuing the next (default: step n+1 is queued before step n is read back)")
    g.add_argument("--prefill-wave-tokens", type=int, default=None, metavar="N",
                   help="while decoding, admit waiting prompts once they add up to N tokens (default: the engine's, 0 = at once)")
    g.add_argument("--speculative-config", type=speculative_arg, default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON form: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' or \'{"model": DRAFT, "num_speculative_tokens": 4}\' '
                        "(docs/speculative.md); the table adds the acceptance rate and mean accepted length")
    g.add_argument("--compare-speculative", action="store_true",
                   help="with --speculative-config: every round runs the workload twice on the one engine, plainly (its "
                        "speculation switched off) and speculating, the order alternating between rounds; reports both and "
                        "the speculative / plain output tokens/s of each round and their median (use an even --repeat and "
                        "--warmup-rounds 1)")
    g.add_argument("--repeat", type=_positive_arg, default=1, metavar="N",
                   help="rounds of the workload on each compile mode's one engine, the prefix cache emptied before every "
                        "round (default 1); the median round is reported (the shorter middle one for an even N), every "
                        "round's duration in the table and its summary under 'rounds' in the JSON. Local engine only (not "
                        "with --url: a server's prefix cache cannot be emptied between rounds)")
    g.add_argument("--warmup-rounds", type=_count_arg, default=0, metavar="N",
                   help="rounds run before the --repeat rounds and not counted (default 0): a GPU's first full run "
                        "also builds attention plans and grows the memory pool; listed under 'warmup_rounds' in the JSON")
    h = p.add_argument_group("over HTTP (--url)")
    h.add_argument("--url", default=None, help="send the workload to this OpenAI-compatible server (e.g. http://127.0.0.1:8000) "
                                              "instead of running an engine here")
    h.add_argument("--served-model-name", default=None, help="the model name to send (default: the first of /v1/models)")
    h.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    h.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests open at once (default: no limit)")
    h.add_argument("--client-processes", type=_positive_arg, default=1, metavar="N",
                   help="send from N client processes, the requests dealt round-robin (default 1): one process reads "
                        "about 28,000 streamed chunks/s, beyond which it, not the server, sets the latencies measured")
    h.add_argument("--vocab-size", type=int, default=None,
                   help="draw prompt token ids below this (default: the vocabulary of --model / --tokenizer, else the default model's)")
    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, default=None, metavar="PATH", help="write all numbers, the workload and the environment here")
    o.add_argument("--quiet", action="store_true", help="no progress or logs; only the table")
    p.set_defaults(func=cmd_serve)


def build_engine(args: argparse.Namespace, decode_compile: Any):
    """The engine to benchmark: --model's checkpoint, or --shape's random weights."""
    from ingot.llm import LLM

    return LLM(**llm_kwargs(args, decode_compile)).engine


def llm_kwargs(args: argparse.Namespace, decode_compile: Any) -> dict[str, Any]:
    """The one place that turns parsed options into ``LLM(...)`` keyword arguments."""
    from ingot.engine_args import model_overrides

    kw: dict[str, Any] = {"dtype": args.dtype, "device": args.device, "decode_compile": decode_compile,
                          "enable_prefix_caching": not args.no_prefix_caching,
                          "overlap_scheduling": not args.no_overlap_scheduling, **model_overrides(args)}
    if getattr(args, "prefill_wave_tokens", None) is not None:
        kw["prefill_wave_tokens"] = args.prefill_wave_tokens
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.eager:
        kw["eager_mode"] = True
    if getattr(args, "speculative_config", None) is not None:
        kw["speculative_config"] = args.speculative_config
    if args.quiet:
        kw["show_progress"] = False
    return kw


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def environment(eng, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import ingot
    from ingot.bench.decode import dtype_of

    device = eng.executor.device
    model = args.shape or args.model or "default (SmolLM2-135M-Instruct)"

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ingot": ingot.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": device_name(device),
        "cpu_threads": torch.get_num_threads(),
        "model": f"random weights, {model}" if eng.config.load_format == "dummy" else model,
        "architecture": eng.model_config.architecture,
        "dtype": str(eng.executor.run_on_ranks(dtype_of)).removeprefix("torch."),
        "max_model_len": eng.max_model_len,
        "max_num_seqs": eng.config.max_num_seqs,
        "eager": eng.config.eager_mode,
        "prefix_caching": eng.config.enable_prefix_caching,
        "overlap_scheduling": eng.config.overlap_scheduling,
        "speculative_config": as_json(eng.config.speculative_config),
    }


def run_mode(args: argparse.Namespace, workload, mode: str, console, repeat: int = 1,
             warmup_rounds: int = 0, structured: Any = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Build one engine for a compile mode, warm it up once, run ``warmup_rounds`` rounds
    that are not counted, then ``repeat`` rounds of the workload, the prefix cache emptied
    before every run (a run never hits an earlier run's prompts): (the results, each its
    median round; environment). With ``--compare-speculative`` a round runs the workload
    plainly and speculating (``round_order``), and the speculative result holds the
    speed-up. ``structured`` constrains every request (and the warm-up, which so compiles
    the grammar before the timed rounds)."""
    from ingot.bench.serve import round_order, run_workload, warm_up
    from ingot.bench.workload import check_fits, make_requests
    from ingot.engine.heap import freeze_heap, unfreeze_heap

    say = (lambda *a: None) if args.quiet else console.print
    say(f"[bold]decode-compile {mode}[/]: loading the model")
    t0 = time.perf_counter()
    eng = build_engine(args, MODES[mode])
    load_s = time.perf_counter() - t0
    device = eng.executor.device
    spec = eng.config.speculative_config
    variants = ["plain", describe(spec)] if args.compare_speculative else [describe(spec) if spec else None]
    try:
        if mode != "off" and device.type != "cuda":
            console.print(f"[yellow]note[/]: decode compile only applies on CUDA; on {device} decode runs uncompiled, as with off")
        requests = make_requests(workload, eng.model_config.vocab_size, eng.tokenizer)
        check_fits(requests, eng.max_model_len)
        warmup_s = warm_up(eng, structured=structured)
        say(f"warm-up {warmup_s:.2f} s")
        freeze_heap()  # as the engine and server processes do once started (ingot/engine/heap.py)
        runs: dict[Any, list] = {v: [] for v in variants}
        total = warmup_rounds + repeat
        for r in range(total):
            for variant in round_order(variants, r):
                emptied = eng.reset_prefix_cache()
                assert emptied, "the engine is idle between runs"
                rounds = f"round {r + 1}/{total}{' (warm-up)' if r < warmup_rounds else ''}: " if total > 1 else ""
                say(f"[bold]{rounds}[/]running {len(requests)} requests{f' ({variant})' if variant else ''}")
                with speculation_off(eng) if variant == "plain" else contextlib.nullcontext():
                    runs[variant].append(_run_with_progress(eng, requests, args.quiet, console, run_workload, structured))
        results = [_result(mode, v, runs[v], warmup_rounds, load_s, warmup_s) for v in variants]
        if args.compare_speculative:
            plain, speculative = (runs[v][warmup_rounds:] for v in variants)
            results[1]["speedup"] = speedup([m.output_throughput for m in plain], [m.output_throughput for m in speculative])
        env = environment(eng, args)
        if structured is not None:
            env["json_schema"] = str(args.json_schema)
    finally:
        unfreeze_heap()  # the engine's reference cycles must be reclaimable before the next one
        eng.close()
        eng.release()  # the model, KV cache and graphs: device memory for the next variant's engine
    return results, env


def _result(mode: str, variant: Optional[str], runs: list, warmup_rounds: int, load_s: float, warmup_s: float) -> dict[str, Any]:
    """One column of the table: the median counted round, every round's summary."""
    from ingot.bench.serve import median_round, round_summary

    warm, counted = runs[:warmup_rounds], runs[warmup_rounds:]
    k = median_round(counted)
    result = {"mode": mode, "speculative": variant, "load_s": load_s, "warmup_s": warmup_s, **dataclasses.asdict(counted[k])}
    if len(counted) > 1:
        result["median_round"] = k
        result["rounds"] = [round_summary(m) for m in counted]
    if warm:
        result["warmup_rounds"] = [round_summary(m) for m in warm]
    return result


def run_http_mode(args: argparse.Namespace, workload, console) -> tuple[dict[str, Any], dict[str, Any]]:
    """The workload over HTTP to ``args.url``: (result, environment)."""
    import ingot
    from ingot.bench.http_serve import run_http
    from ingot.bench.workload import make_requests
    from ingot.engine import event_loop
    from ingot.engine.heap import freeze_heap, unfreeze_heap

    tokenizer = _tokenizer_of(args.tokenizer or args.model) if workload.kind == "copy" or not args.vocab_size else None
    vocab = args.vocab_size or tokenizer.vocab_size
    requests = make_requests(workload, vocab, tokenizer)
    if not args.quiet:
        console.print(f"[bold]{args.url}[/]: sending {len(requests)} requests")
    freeze_heap()  # as the server's processes do (ingot/engine/heap.py): the client's collector out of the chunks' bursts
    try:
        out = event_loop.run(run_http(args.url, requests, args.served_model_name, args.api_key, args.max_concurrency,
                                      client_processes=args.client_processes))
    finally:
        unfreeze_heap()
    if out.failed:
        console.print(f"[yellow]{out.failed} request(s) failed[/]; first: {out.errors[0]}")
    result = {"mode": "http", **dataclasses.asdict(out.metrics), "failed": out.failed,
              "errors": out.errors}
    # what the server says of itself (/v1/models, /version); nothing is made up for the rest
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "ingot": ingot.__version__,
           "python": platform.python_version(), "platform": platform.platform(), "url": args.url,
           "model": out.server.get("id") or args.served_model_name, "max_model_len": out.server.get("max_model_len"),
           "server_version": out.server.get("version"), "device": "http", "device_name": args.url,
           "vocab_size": vocab, "max_concurrency": args.max_concurrency, "client_processes": args.client_processes}
    return result, env


def _tokenizer_of(model) -> Any:
    """``model``'s tokenizer ('default' or None: the default model's)."""
    from ingot.loading.checkpoint import open_tokenizer

    return open_tokenizer(model or "default")


def _run_with_progress(eng, requests, quiet: bool, console, run_workload, structured: Any = None):
    if quiet:
        return run_workload(eng, requests, structured=structured)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("requests", total=sum(1 + len(r.next_turns) for r in requests))
        return run_workload(eng, requests, on_finish=lambda: bar.advance(task), structured=structured)


def _structured(args: argparse.Namespace) -> Any:
    """``--json-schema``'s file as the constraint of every request (None without it)."""
    from ingot.bench.workload import WorkloadError
    from ingot.engine import structured
    from ingot.sampling_params import StructuredOutputsParams

    if args.json_schema is None:
        return None
    if args.url:
        raise WorkloadError("--json-schema runs on a local engine only (not with --url)")
    try:
        spec = StructuredOutputsParams(json=args.json_schema.read_text())
        structured.check(spec)  # what xgrammar rejects, before any engine is built
    except (OSError, ValueError) as exc:
        raise WorkloadError(f"--json-schema {args.json_schema}: {exc}") from None
    return spec


def cmd_serve(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ingot.bench.workload import Workload, WorkloadError

    err = Console(stderr=True)
    results: list[dict[str, Any]] = []
    env: dict[str, Any] = {}
    try:
        multi = args.workload == "multi-turn"
        if args.turns is not None and not multi:
            raise WorkloadError("--turns applies to --workload multi-turn only")
        if multi and args.url:
            raise WorkloadError("--workload multi-turn runs on a local engine only (not with --url)")
        if (args.repeat > 1 or args.warmup_rounds) and args.url:
            raise WorkloadError("--repeat and --warmup-rounds run on a local engine only (not with --url): a server's prefix cache "
                                "cannot be emptied between rounds, so later rounds would hit the first round's prompts")
        if args.compare_speculative and args.speculative_config is None:
            raise WorkloadError("--compare-speculative needs --speculative-config (the speculation to compare with plain decoding)")
        if args.url and (args.speculative_config is not None or args.compare_speculative):
            raise WorkloadError("--speculative-config and --compare-speculative configure a local engine (not with --url): "
                                "start the server with ingot serve --speculative-config JSON")
        turns = (args.turns or (2, 6)) if multi else (1, 1)
        structured = _structured(args)
        workload = Workload(args.num_requests, args.input_len, args.output_len, args.request_rate, args.seed,
                            shared_prefix_len=args.shared_prefix_len, kind=args.workload, turns=turns)
        if args.url:
            result, env = run_http_mode(args, workload, err)
            results.append(result)
        for mode in [] if args.url else args.compile_modes:
            mode_results, env = run_mode(args, workload, mode, err, args.repeat, args.warmup_rounds, structured)
            results += mode_results
    except WorkloadError as exc:
        print(f"ingot: error: {exc}", file=sys.stderr)
        return 2
    out = Console()
    out.print(header(workload, env), highlight=False)
    out.print(render_table(results))
    for line in speedup_lines(results):
        out.print(line, highlight=False)
    if args.json is not None:
        from ingot.bench.report import write_json

        write_json(args.json, {"workload": workload.to_json(), "environment": env, "results": results})
        if not args.quiet:
            err.print(f"wrote {args.json}")
    return 0
