"""Logprobs of prompt tokens (``SamplingParams.prompt_logprobs``), from a prefill chunk's hidden states.

Position ``p`` of a prompt predicts token ``p + 1``: a chunk covering positions
``[s, e)`` yields the entries of prompt tokens ``s + 1 .. min(e, len(prompt) - 1)``.
Only rows that ask pay for the lm_head over their whole chunk. The runner
computes the logits of each row's span of hidden states (``prompt_spans``; the
device part, which every tensor-parallel rank runs) and turns them into entries
on the host (``span_entries``) one span at a time, so one span's logits are
alive at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ingot.runner.batch import ScheduledBatch
from ingot.runner.sampler import TokenLogprobs


@dataclass(frozen=True)
class PromptSpan:
    row: int  # batch row
    start: int  # hidden-state rows [start, stop) whose logits the row's entries need
    stop: int


def prompt_spans(batch: ScheduledBatch) -> list[PromptSpan]:
    """One span per prefill row that asks for prompt logprobs (empty when its chunk
    predicts no prompt token)."""
    if not batch.is_prefill:
        return []
    spans = []
    start = 0
    for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        if seq.params.prompt_logprobs is not None:
            first = seq.num_computed_tokens  # position of the chunk's first token
            last = min(first + n, len(seq.prompt_token_ids) - 1)  # positions [first, last)
            spans.append(PromptSpan(row, start, start + max(0, last - first)))
        start += n
    return spans


@torch.inference_mode()
def span_entries(logits: torch.Tensor, batch: ScheduledBatch, span: PromptSpan) -> list[TokenLogprobs]:
    """One entry list per prompt token the span predicts: the (token, logprob, rank) of
    the prompt token, then of the top-n tokens."""
    seq = batch.seqs[span.row]
    first = seq.num_computed_tokens
    last = first + (span.stop - span.start)
    lp = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(seq.prompt_token_ids[first + 1 : last + 1], device=lp.device)
    chosen = lp.gather(1, targets[:, None])
    ranks = (lp > chosen).sum(dim=-1) + 1
    top_n = min(seq.params.prompt_logprobs, lp.shape[1])
    top_v, top_i = lp.topk(top_n, dim=-1) if top_n else (lp[:, :0], lp[:, :0].long())
    values, ranks, top_v, top_i = chosen[:, 0].tolist(), ranks.tolist(), top_v.tolist(), top_i.tolist()
    return [
        [(t, v, rank)] + [(int(i), tv, k + 1) for k, (tv, i) in enumerate(zip(tvs, tis))]
        for t, v, rank, tvs, tis in zip(seq.prompt_token_ids[first + 1 : last + 1], values, ranks, top_v, top_i)
    ]
