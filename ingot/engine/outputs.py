"""RequestState (one request's samples inside the engine) and the RequestOutput built from it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from ingot.engine.request import EngineRequest
from ingot.engine.sequence import Sequence
from ingot.loading.tokenizer import Tokenizer
from ingot.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


@dataclass
class RequestState:
    """An admitted request and its ``n`` sample sequences."""

    request: EngineRequest
    seqs: list[Sequence]
    emitted: bool = False  # an output of it has been built

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


def build_output(state: RequestState, tokenizer: Tokenizer, cumulative: bool = True) -> RequestOutput:
    """A snapshot of the request now: every sample's text and tokens so far, and what each
    gained since the previous output of this request (``delta``, ``delta_token_ids``).

    ``cumulative=False``: ``text``, ``token_ids`` and ``logprobs`` hold only that gain too,
    the prompt (ids and logprobs) comes only with the first output and the metrics only
    with the last: the compact form a client accumulates (``engine/wire.py``), which costs
    the same at every step instead of growing with the output."""
    req = state.request
    completions = [_completion(seq, tokenizer, cumulative) for seq in state.seqs]
    errors = [s.error for s in state.seqs if s.error]
    first = state.seqs[0]
    head = cumulative or not state.emitted
    state.emitted = True
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt if head else None,
        prompt_token_ids=req.prompt_token_ids if head else [],
        outputs=completions,
        finished=state.finished,
        error=errors[0] if errors else None,
        prompt_logprobs=_prompt_logprobs(first, tokenizer) if head else None,
        metrics=_metrics(state) if cumulative or state.finished else None,
        num_cached_tokens=first.num_cached_tokens,
    )


def _completion(seq: Sequence, tokenizer: Tokenizer, cumulative: bool) -> CompletionOutput:
    delta = seq.text[seq.emitted_text :]
    delta_ids = seq.output_token_ids[seq.emitted_tokens :]
    logprobs = None
    if seq.logprobs is not None:
        entries = seq.logprobs if cumulative else seq.logprobs[seq.emitted_tokens :]
        logprobs = [_logprob_dict(e, tokenizer) for e in entries]
    seq.emitted_text, seq.emitted_tokens = len(seq.text), len(seq.output_token_ids)
    return CompletionOutput(
        index=seq.index,
        text=seq.text if cumulative else delta,
        token_ids=list(seq.output_token_ids) if cumulative else delta_ids,
        cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
        logprobs=logprobs,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        delta=delta,
        delta_token_ids=delta_ids,
    )


def _logprob_dict(entries: list[tuple[int, float, int]], tokenizer: Tokenizer) -> dict[int, Logprob]:
    """{token: Logprob} of one position: the sampled token, then the top-n (vLLM's layout)."""
    out: dict[int, Logprob] = {}
    for token, lp, rank in entries:
        if token not in out:
            out[token] = Logprob(lp, rank, tokenizer.decode([token]))
    return out


def _prompt_logprobs(seq: Sequence, tokenizer: Tokenizer) -> Optional[list[Optional[dict[int, Logprob]]]]:
    entries = seq.prompt_logprobs
    if entries is None:
        return None
    return [None if e is None else _logprob_dict(e, tokenizer) for e in entries]


def _metrics(state: RequestState) -> RequestMetrics:
    """Wall-clock milestones; the engine stamps monotonic times, shifted here by the
    request's arrival on both clocks."""
    req = state.request

    def wall(t: Optional[float]) -> Optional[float]:
        return None if t is None else req.arrival_wall + (t - req.arrival_time)

    seqs = state.seqs
    firsts = [s.first_token_time for s in seqs if s.first_token_time is not None]
    lasts = [s.token_times[-1] for s in seqs if s.token_times]
    scheduled = [s.first_scheduled_time for s in seqs if s.first_scheduled_time is not None]
    return RequestMetrics(
        arrival_time=req.arrival_wall,
        first_scheduled_time=min(scheduled) if scheduled else None,
        first_token_time=wall(min(firsts)) if firsts else None,
        last_token_time=wall(max(lasts)) if lasts else None,
        finished_time=time.time() if state.finished else None,
        num_preemptions=sum(s.num_preemptions for s in seqs),
    )
