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
                                      m.finished_time, m.num_preemptions)
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


def error_wire(request_id: str, n: int, message: str, prompt: Any = None, prompt_ids: Optional[list] = None) -> Wire:
    """The encoded final output of a request that failed outside any step."""
    seqs = [(i, "", [], "error", None, None, None) for i in range(n)]
    return (request_id, True, message, 0, prompt, prompt_ids or [], None, None, seqs)
