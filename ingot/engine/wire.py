"""RequestOutputs as plain tuples, for the pipe between the engine process and its client.

The engine builds compact outputs (each carries only what changed), ``encode``
turns one into nested tuples of plain values (pickling those is about ten times
cheaper than pickling the dataclasses) and ``decode`` turns them back; the
client then adds them up (``outputs.Accumulator``).
"""

from __future__ import annotations

from typing import Any, Optional

from ingot.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

Wire = tuple


def _enc_positions(positions: Optional[list]) -> Optional[list]:
    if positions is None:
        return None
    return [None if p is None else [(t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in p.items()] for p in positions]


def _dec_positions(positions: Optional[list]) -> Optional[list]:
    if positions is None:
        return None
    return [None if p is None else {t: Logprob(lp, rank, text) for t, lp, rank, text in p} for p in positions]


def encode(out: RequestOutput) -> Wire:
    m = out.metrics
    metrics = None if m is None else (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time,
                                      m.finished_time, m.num_preemptions, m.spec_num_drafts, m.spec_num_draft_tokens,
                                      m.spec_num_accepted_tokens)
    seqs = [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob,
             _enc_positions(c.logprobs)) for c in out.outputs]
    return (out.request_id, out.finished, out.error, out.num_cached_tokens, out.prompt, out.prompt_token_ids,
            _enc_positions(out.prompt_logprobs), metrics, seqs)


def decode(wire: Wire) -> RequestOutput:
    """The compact RequestOutput ``encode`` was given."""
    rid, finished, error, cached, prompt, prompt_ids, prompt_lp, metrics, seqs = wire
    outputs = []
    for index, text, ids, reason, stop_reason, cum_lp, lps in seqs:
        ids = list(ids)
        outputs.append(CompletionOutput(index, text, ids, cum_lp, _dec_positions(lps), reason, stop_reason, text, ids))
    return RequestOutput(rid, prompt, list(prompt_ids), outputs, finished, error, _dec_positions(prompt_lp),
                         None if metrics is None else RequestMetrics(*metrics), cached)


def merge(wires: list[Wire]) -> Wire:
    """One request's encoded outputs of several steps as one (texts, token ids and logprobs
    joined; the rest from the last, the prompt from the first): a client that reads a
    backlog decodes and delivers once per request instead of once per step."""
    if len(wires) == 1:
        return wires[0]
    first, last = wires[0], wires[-1]
    samples: dict[int, list] = {}
    for wire in wires:
        for index, text, ids, reason, stop_reason, cum_lp, lps in wire[8]:
            got = samples.get(index)
            if got is None:
                samples[index] = [index, text, list(ids), reason, stop_reason, cum_lp, None if lps is None else list(lps)]
                continue
            got[1] += text
            got[2] += ids
            got[3], got[4], got[5] = reason, stop_reason, cum_lp
            if lps is not None:
                got[6] = lps if got[6] is None else got[6] + lps
    error = next((w[2] for w in reversed(wires) if w[2] is not None), None)
    return (last[0], last[1], error, last[3], first[4], first[5], first[6], last[7],
            [tuple(samples[i]) for i in sorted(samples)])


def error_wire(request_id: str, n: int, message: str, prompt: Any = None, prompt_ids: Optional[list] = None) -> Wire:
    """The encoded final output of a request that failed outside any step."""
    seqs = [(i, "", [], "error", None, None, None) for i in range(n)]
    return (request_id, True, message, 0, prompt, prompt_ids or [], None, None, seqs)
