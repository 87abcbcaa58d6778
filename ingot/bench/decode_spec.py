"""`ingot bench decode --speculative-k K,...`: speculative decoding's verify step against a plain
decode step, per batch size.

For batch ``b`` and ``k`` drafts per sequence, the verify step is ``b * (k + 1)`` decode rows
(each sequence's last token and its drafts, ``step_inputs._verify_step``) replayed from a
verify graph (``store_first``: every row's K/V stored before any row attends), then the
device part of ``verify_drafts`` for greedy rows; the plain decode step is ``b`` rows
replayed from a decode graph, then the greedy sampler. Each is timed alone (CUDA events,
median), as the engine runs a verify step: it is read back at once, never overlapped. The
verify graphs are captured into the decode graphs' memory pool, one per row count.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ingot.bench import report
from ingot.config import MAX_SPECULATIVE_TOKENS
from ingot.runner.batch import ScheduledBatch
from ingot.runner.graph_runner import DecodeGraphRunner
from ingot.runner.model_runner import ModelRunner
from ingot.runner.sampler import SamplingRow
from ingot.runner.spec_verify import verify_drafts
from ingot.sampling_params import SamplingParams


@dataclass
class VerifyTiming:
    """One batch size and draft count: the verify step against the plain decode step."""

    k: int  # drafts per sequence
    rows: int  # the verify step's rows: batch * (k + 1)
    verify_ms: float  # verify-graph replay + verify_drafts (greedy)
    verify_graph_ms: float  # the replay alone
    decode_ms: float  # decode-graph replay of the batch + greedy sampling
    decode_graph_ms: float  # the replay alone


def speculative_ks(text: str) -> list[int]:
    """``--speculative-k``: draft counts in 1..MAX_SPECULATIVE_TOKENS."""
    ks = report.positive_int_list(text)
    if max(ks) > MAX_SPECULATIVE_TOKENS:
        raise argparse.ArgumentTypeError(f"draft counts go up to {MAX_SPECULATIVE_TOKENS}, got {max(ks)}")
    return ks


def verify_batch(decode: ScheduledBatch, k: int, vocab_size: int, seed: int = 0) -> ScheduledBatch:
    """``decode``'s sequences, each with ``k`` random drafts (their blocks must hold them)."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.randint(0, min(1000, vocab_size), (len(decode.seqs), k), generator=gen).tolist()
    return ScheduledBatch(decode.seqs, False, [1 + k] * len(decode.seqs), draft_tokens=drafts)


def _greedy_rows(batch: ScheduledBatch) -> list[SamplingRow]:
    params = SamplingParams(temperature=0.0)
    return [SamplingRow(params, seq.prompt_token_ids, seq.output_token_ids, None) for seq in batch.seqs]


def time_verify_steps(runner: ModelRunner, graphs: DecodeGraphRunner, decode_batches: dict[int, ScheduledBatch],
                      ks: list[int], iters: int, timer: Callable[..., float]) -> dict[int, list[VerifyTiming]]:
    """Per batch size (the keys of ``decode_batches``, each a decode step whose sequences have
    blocks for ``max(ks)`` more tokens): one ``VerifyTiming`` per draft count. ``graphs``: the
    mode's decode graphs (a bucket per batch size); the verify graphs, one per row count, are
    captured into their pool (compiled as they are) and dropped at the end. ``timer(fn, iters,
    device)``: median ms of ``fn``."""
    vocab = runner.model_config.vocab_size
    rows = sorted({b * (k + 1) for b in decode_batches for k in ks})
    verify = DecodeGraphRunner(runner.model, graphs.config, runner.device, graphs.max_blocks, runner.policy, runner.tp,
                               store_first=True, buckets=rows, pool=graphs.pool)
    verify.capture_all()
    sampler, device = runner.sampler, runner.device
    out: dict[int, list[VerifyTiming]] = {}
    for b, batch in decode_batches.items():
        inputs, greedy = runner.stage(batch), _greedy_rows(batch)
        decode_graph_ms = timer(lambda: graphs.run(inputs), iters, device)
        decode_ms = timer(lambda: sampler.sample(graphs.run(inputs), greedy), iters, device)
        out[b] = []
        for k in ks:
            vbatch = verify_batch(batch, k, vocab, seed=k)
            vinputs = runner.stage(vbatch)
            drafts = vbatch.draft_tokens
            assert drafts is not None
            graph_ms = timer(lambda: verify.run(vinputs), iters, device)
            step_ms = timer(lambda: verify_drafts(sampler, verify.run(vinputs), greedy, drafts), iters, device)
            out[b].append(VerifyTiming(k, vinputs.num_seqs, step_ms, graph_ms, decode_ms, decode_graph_ms))
    del verify
    return out


def summarize(rows: list[Any]) -> list[dict[str, Any]]:
    """Per mode, batch size and draft count (``BucketTiming.speculative``): the timings and the
    verify step's cost in plain decode steps, with and without the sampling."""
    out = []
    for row in rows:
        for mode, timings in row.speculative.items():
            for t in timings:
                out.append({"mode": mode, "batch": row.batch, "k": t.k, "rows": t.rows, "decode_ms": t.decode_ms,
                            "verify_ms": t.verify_ms, "ratio": t.verify_ms / t.decode_ms,
                            "decode_graph_ms": t.decode_graph_ms, "verify_graph_ms": t.verify_graph_ms,
                            "graph_ratio": t.verify_graph_ms / t.decode_graph_ms})
    return out


def make_table(source: str, context_len: int, iters: int, rows: list[Any]):
    """One row per (mode, batch size, draft count); a separator between batch sizes."""
    summary = summarize(rows)
    columns = ["mode", "batch", "k", "rows", "decode ms", "verify ms", "verify / decode", "decode graph ms",
               "verify graph ms", "graph ratio"]
    cells: list[list[str]] = []
    ends: list[int] = []
    for i, s in enumerate(summary):
        first = i == 0 or (summary[i - 1]["mode"], summary[i - 1]["batch"]) != (s["mode"], s["batch"])
        if first and cells:
            ends.append(len(cells) - 1)
        cells.append([s["mode"] if first else "", str(s["batch"]) if first else "", str(s["k"]), str(s["rows"]),
                      report.fmt(s["decode_ms"], ".3f"), report.fmt(s["verify_ms"], ".3f"), f"{s['ratio']:.2f}x",
                      report.fmt(s["decode_graph_ms"], ".3f"), report.fmt(s["verify_graph_ms"], ".3f"),
                      f"{s['graph_ratio']:.2f}x"])
    title = f"verify step vs decode step, {source}, context {context_len} (median of {iters})"
    caption = ("decode: the batch's decode graph + greedy sampling; verify: batch x (k + 1) rows through a verify "
               "graph + verify_drafts (greedy rows); each step timed alone, as the engine runs a verify step; "
               "graph: the replays alone")
    return report.make_table(title, columns, cells, right_align=columns[1:], section_ends=ends, caption=caption)
