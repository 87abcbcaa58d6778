"""RequestOutputs as plain tuples, for the pipe between the engine process and its client.

The engine process builds compact outputs (``build_output(..., cumulative=False)``:
each carries only what changed), ``encode`` turns one into nested tuples of
plain values (pickling those is about ten times cheaper than pickling the
dataclasses), and the client's ``Accumulator`` turns them back into the
cumulative RequestOutputs that ``LLM`` and ``AsyncLLM`` callers read.
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


def request_key(wire: Wire) -> tuple[str, bool]:
    """(request id, finished) of an encoded output."""
    return wire[0], wire[1]


class Accumulator:
    """Per request, the cumulative output the compact outputs add up to."""

    def __init__(self) -> None:
        self._live: dict[str, RequestOutput] = {}

    def update(self, wire: Wire) -> RequestOutput:
        rid, finished, error, cached, prompt, prompt_ids, prompt_lp, metrics, seqs = wire
        prev = self._live.get(rid)
        if prev is None:
            prev = RequestOutput(rid, prompt, list(prompt_ids), [], False, None, _dec_positions(prompt_lp))
        outputs: dict[int, CompletionOutput] = {c.index: c for c in prev.outputs}
        for index, text, ids, reason, stop_reason, cum_lp, lps in seqs:
            old = outputs.get(index)
            new_lps = _dec_positions(lps)
            outputs[index] = CompletionOutput(
                index=index,
                text=(old.text if old else "") + text,
                token_ids=(old.token_ids if old else []) + list(ids),
                cumulative_logprob=cum_lp,
                logprobs=None if new_lps is None else ((old.logprobs or []) if old else []) + new_lps,
                finish_reason=reason,
                stop_reason=stop_reason,
                delta=text,
                delta_token_ids=list(ids),
            )
        out = RequestOutput(
            request_id=rid,
            prompt=prev.prompt,
            prompt_token_ids=prev.prompt_token_ids,
            outputs=[outputs[i] for i in sorted(outputs)],
            finished=finished,
            error=error,
            prompt_logprobs=prev.prompt_logprobs if prompt_lp is None else _dec_positions(prompt_lp),
            metrics=None if metrics is None else RequestMetrics(*metrics),
            num_cached_tokens=cached,
        )
        if finished:
            self._live.pop(rid, None)
        else:
            self._live[rid] = out
        return out

    def forget(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._live)


def error_wire(request_id: str, n: int, message: str, prompt: Any = None, prompt_ids: Optional[list] = None) -> Wire:
    """The encoded final output of a request that failed outside any step."""
    seqs = [(i, "", [], "error", None, None, None) for i in range(n)]
    return (request_id, True, message, 0, prompt, prompt_ids or [], None, None, seqs)
