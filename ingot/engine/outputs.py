"""RequestState (one request's samples inside the engine) and the RequestOutput built from it."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Iterable, Optional

from ingot.engine.request import EngineRequest
from ingot.engine.sequence import Sequence, Status
from ingot.engine.speculative import spec_metrics
from ingot.loading.tokenizer import Tokenizer
from ingot.runner.batch import ScheduledBatch
from ingot.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


@dataclass
class RequestState:
    """An admitted request and its ``n`` sample sequences."""

    request: EngineRequest
    seqs: list[Sequence]
    emitted: bool = False  # an output of it has been built

    @property
    def finished(self) -> bool:
        for s in self.seqs:  # a loop, not all(): read for every request on every step
            if s.status is not Status.FINISHED:
                return False
        return True


def build_output(state: RequestState, tokenizer: Tokenizer) -> RequestOutput:
    """What the request gained since its previous output: each sample's new text, token ids
    and logprobs (in ``text``, ``token_ids``, ``logprobs`` and the same in ``delta`` /
    ``delta_token_ids``), the prompt with the first output only, the metrics with the last.

    Compact on purpose: it costs the same at every step instead of growing with the output.
    Whoever reads outputs adds them up (``Accumulator``): ``LLM`` and ``AsyncLLM`` in their
    callers' threads, never the engine's.
    """
    req = state.request
    seqs = state.seqs
    completions = [_completion(seq, tokenizer) for seq in seqs]
    first = seqs[0]
    error = first.error if len(seqs) == 1 else next((s.error for s in seqs if s.error), None)
    head = not state.emitted
    state.emitted = True
    finished = state.finished
    return RequestOutput(
        req.request_id,
        req.prompt if head else None,
        req.prompt_token_ids if head else [],
        completions,
        finished,
        error,
        _prompt_logprobs(first, tokenizer) if head and first.prompt_logprobs is not None else None,
        _metrics(state) if finished else None,
        first.num_cached_tokens,
    )


class Accumulator:
    """Adds up a request's compact outputs into the cumulative RequestOutputs callers read
    (each a new snapshot: a reader lagging behind never sees a later step's text)."""

    def __init__(self) -> None:
        self._live: dict[str, RequestOutput] = {}

    def add(self, delta: RequestOutput) -> RequestOutput:
        prev = self._live.get(delta.request_id)
        if prev is None:
            prev = RequestOutput(delta.request_id, delta.prompt, list(delta.prompt_token_ids), [], False, None,
                                 delta.prompt_logprobs)
        olds, news = prev.outputs, delta.outputs
        if len(news) == 1 and (not olds or (len(olds) == 1 and olds[0].index == news[0].index)):
            outputs = [_added(olds[0] if olds else None, news[0])]  # one sample (n = 1): no regrouping
        else:
            samples: dict[int, CompletionOutput] = {c.index: c for c in olds}
            for c in news:
                samples[c.index] = _added(samples.get(c.index), c)
            outputs = [samples[i] for i in sorted(samples)]
        out = RequestOutput(delta.request_id, prev.prompt, prev.prompt_token_ids, outputs, delta.finished, delta.error,
                            prev.prompt_logprobs if delta.prompt_logprobs is None else delta.prompt_logprobs,
                            delta.metrics, delta.num_cached_tokens)
        if out.finished:
            self._live.pop(out.request_id, None)
        else:
            self._live[out.request_id] = out
        return out

    def add_all(self, deltas: Iterable[RequestOutput]) -> list[RequestOutput]:
        """Several compact outputs at once, as a reader that fell behind finds them: one
        cumulative output per request (in order of first appearance) whose ``delta`` /
        ``delta_token_ids`` span all of that request's outputs among them. A lagging
        server thus sends one chunk per request for what piled up, not one per step."""
        by_request: dict[str, list[RequestOutput]] = {}
        for delta in deltas:
            got = by_request.get(delta.request_id)
            if got is None:
                by_request[delta.request_id] = [delta]
            else:
                got.append(delta)
        return [self.add(piled[0]) if len(piled) == 1 else self._add_piled(piled) for piled in by_request.values()]

    def _add_piled(self, piled: list[RequestOutput]) -> RequestOutput:
        """One request's outputs of several steps as one cumulative output."""
        prev = self._live.get(piled[0].request_id)
        before = {} if prev is None else {c.index: (len(c.text), len(c.token_ids)) for c in prev.outputs}
        for delta in piled:
            out = self.add(delta)
        samples = []
        for c in out.outputs:
            text0, tokens0 = before.get(c.index, (0, 0))
            samples.append(replace(c, delta=c.text[text0:], delta_token_ids=c.token_ids[tokens0:]))
        return replace(out, outputs=samples)


def _added(old: Optional[CompletionOutput], c: CompletionOutput) -> CompletionOutput:
    """Sample ``c``'s compact output added to its cumulative output so far (``old``)."""
    if old is None:
        return CompletionOutput(c.index, c.delta, list(c.delta_token_ids), c.cumulative_logprob, c.logprobs,
                                c.finish_reason, c.stop_reason, c.delta, c.delta_token_ids)
    logprobs = c.logprobs
    if logprobs is not None and old.logprobs:
        logprobs = old.logprobs + logprobs
    return CompletionOutput(c.index, old.text + c.delta, old.token_ids + c.delta_token_ids, c.cumulative_logprob,
                            logprobs, c.finish_reason, c.stop_reason, c.delta, c.delta_token_ids)


def _completion(seq: Sequence, tokenizer: Tokenizer) -> CompletionOutput:
    delta = seq.text[seq.emitted_text :]
    delta_ids = seq.output_token_ids[seq.emitted_tokens :]
    logprobs = None
    if seq.logprobs is not None:
        logprobs = [_logprob_dict(e, tokenizer) for e in seq.logprobs[seq.emitted_tokens :]]
    seq.emitted_text, seq.emitted_tokens = len(seq.text), len(seq.output_token_ids)
    return CompletionOutput(seq.index, delta, delta_ids, seq.cumulative_logprob if logprobs is not None else None,
                            logprobs, seq.finish_reason, seq.stop_reason, delta, delta_ids)


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
        **spec_metrics(seqs),
    )


def failed_output(request_id: str, prompt: Optional[str], prompt_token_ids: list[int], n: int, message: str) -> RequestOutput:
    """The final output of a request that failed before or outside any step (``n`` samples)."""
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        outputs=[CompletionOutput(i, "", [], finish_reason="error") for i in range(n)],
        finished=True,
        error=message,
    )


def record_prompt_logprobs(batch: ScheduledBatch, by_row: dict, computed: list[int]) -> None:
    """Append each row's new prompt-token entries (a chunk recomputed after a preemption
    repeats positions already recorded: those are skipped). ``computed``: each row's
    computed tokens once the step was launched."""
    for row, entries in by_row.items():
        seq = batch.seqs[row]
        done = len(seq.prompt_logprobs)  # prompt tokens covered so far (the first is None)
        first = computed[row] - batch.num_new_tokens[row] + 1  # the prompt token the chunk's first entry is for
        seq.prompt_logprobs.extend(entries[max(0, done - first):])
