"""The table ``ingot bench serve`` prints: a column per run (compile mode; with speculation,
plain and speculative), a row per number, and the speed-up lines of a speculative comparison."""

from __future__ import annotations

from typing import Any


def _fmt(value: Any, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def header(workload, env: dict[str, Any]) -> str:
    from ingot.bench.workload import format_rate

    w = workload
    what = f"{w.num_requests} requests, input {w.input_len[0]}-{w.input_len[1]}"
    if w.kind == "multi-turn":
        what = f"{w.num_requests} conversations of {w.turns[0]}-{w.turns[1]} turns, user messages {w.input_len[0]}-{w.input_len[1]}"
    elif w.kind == "copy":
        what = f"{w.num_requests} copy requests (repeat standard-library code or text), input {w.input_len[0]}-{w.input_len[1]}"
    if w.shared_prefix_len:
        what += f" after a shared {w.shared_prefix_len}-token prefix"
    if env.get("json_schema"):
        what += f", outputs constrained by the JSON schema {env['json_schema']}"
    if env.get("device") == "http":  # a server: only what it told about itself
        known = [f"max_model_len {env['max_model_len']}" if env.get("max_model_len") else "",
                 f"server version {env['server_version']}" if env.get("server_version") else ""]
        details = ", ".join(k for k in known if k)
        machine = f"{env.get('model') or 'model'}{f' ({details})' if details else ''} at {env['url']}, {env['date']}"
    else:
        machine = (f"{env['model']} ({env['architecture']}, {env['dtype']}, max_model_len {env['max_model_len']}, "
                   f"max_num_seqs {env['max_num_seqs']}) on {env['device_name']} [{env['device']}], "
                   f"torch {env['torch']}, {env['date']}")
    return (
        f"[bold]ingot bench serve[/]: {what}, "
        f"output {w.output_len[0]}-{w.output_len[1]} tokens, rate {format_rate(w.request_rate)} req/s, seed {w.seed}\n"
        + machine
    )


def render_table(results: list[dict[str, Any]]):
    from rich.table import Table

    table = Table()
    table.add_column("metric")
    for r in results:
        table.add_column(column_label(r), justify="right")
    rows: list[tuple[str, Any]] = [
        ("duration (s)", lambda r: _fmt(r["duration_s"], 2)),
        ("requests/s", lambda r: _fmt(r["request_throughput"], 2)),
        ("output tokens/s", lambda r: _fmt(r["output_throughput"], 1)),
        ("total tokens/s", lambda r: _fmt(r["total_throughput"], 1)),
        ("input / output tokens", lambda r: f"{r['input_tokens']:,} / {r['output_tokens']:,}"),
    ]
    sections = [("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL")]
    ends = {4}
    for key, name in sections:
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append((f"{name} {stat} (ms)", lambda r, k=key, s=stat: _fmt((r.get(k) or {}).get(s), 1)))
        ends.add(len(rows) - 1)
    rows += [
        ("prefix cache hit rate", lambda r: "-" if r.get("prefix_cache_hit_rate") is None else f"{r['prefix_cache_hit_rate']:.1%}"),
        ("preemptions", lambda r: str(r.get("num_preemptions", "-"))),
        ("prefill / decode steps", lambda r: f"{r['prefill_steps']:,} / {r['decode_steps']:,}" if r.get("decode_steps") else "-"),
        ("mean decode batch", lambda r: _fmt(r.get("mean_decode_batch"), 1)),
        ("failed requests", lambda r: str(r.get("failed", 0))),
        ("schema failures", lambda r: "-" if r.get("schema_failures") is None else str(r["schema_failures"])),
        ("load / warm-up (s)", lambda r: f"{r['load_s']:.2f} / {r['warmup_s']:.2f}" if "load_s" in r else "-"),
    ]
    if any(r.get("speculative") or r.get("spec_num_drafts") for r in results):
        rows += SPEC_ROWS
    if any("rounds" in r for r in results):
        rows.append(("rounds", _rounds_cell))
    for i, (name, cell) in enumerate(rows):
        table.add_row(name, *[cell(r) for r in results], end_section=i in ends)
    return table


def column_label(r: dict[str, Any]) -> str:
    """``compile off``; ``compile off, ngram k=4 (lookup 2-5)`` or ``compile off, plain``
    on an engine with speculation; ``server`` over HTTP."""
    if r["mode"] == "http":
        return "server"
    return f"compile {r['mode']}" + (f", {r['speculative']}" if r.get("speculative") else "")


def _percent(value: Any) -> str:
    return "-" if value is None else f"{value:.1%}"


SPEC_ROWS: list[tuple[str, Any]] = [
    ("spec acceptance rate", lambda r: _percent(r.get("spec_acceptance_rate"))),
    ("spec mean accepted length", lambda r: _fmt(r.get("spec_mean_accepted_length"), 2)),
    ("spec drafts / draft tokens", lambda r: f"{r.get('spec_num_drafts', 0):,} / {r.get('spec_num_draft_tokens', 0):,}"),
    ("output tokens/s over plain", lambda r: f"{r['speedup']['median']:.2f}x" if r.get("speedup") else "-"),
]


def speedup_lines(results: list[dict[str, Any]]) -> list[str]:
    """One line per speculative result measured against plain decoding in the same run."""
    lines = []
    for r in results:
        if r.get("speedup"):
            rounds = " / ".join(f"{x:.2f}x" for x in r["speedup"]["rounds"])
            lines.append(f"speculative / plain output tokens/s, {column_label(r)}: {r['speedup']['median']:.2f}x "
                         f"(median of {len(r['speedup']['rounds'])} round(s): {rounds})")
    return lines


def _rounds_cell(r: dict[str, Any]) -> str:
    """``3 (5.65 / 5.86 / 7.64 s)``: the durations of every round, in round order."""
    rounds = r.get("rounds")
    if not rounds:
        return "1"
    durations = " / ".join(f"{x['duration_s']:.2f}" for x in rounds)
    return f"{len(rounds)} ({durations} s)"
