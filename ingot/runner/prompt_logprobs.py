"""Logprobs of prompt tokens (``SamplingParams.prompt_logprobs``), from a prefill chunk's hidden states.

Position ``p`` of a prompt predicts token ``p + 1``: a chunk covering positions
``[s, e)`` yields the entries of prompt tokens ``s + 1 .. min(e, len(prompt) - 1)``.
Only rows that ask pay for the lm_head over their whole chunk.
"""

from __future__ import annotations

import torch

from ingot.layers.policy import OpPolicy
from ingot.runner.batch import ScheduledBatch
from ingot.runner.sampler import TokenLogprobs


@torch.inference_mode()
def prompt_logprobs(
    model: torch.nn.Module, policy: OpPolicy, hidden: torch.Tensor, batch: ScheduledBatch, rows: list[int]
) -> dict[int, list[TokenLogprobs]]:
    """{batch row: one entry list per prompt token this chunk predicts}, each entry list the
    (token, logprob, rank) of the prompt token, then of the top-n tokens."""
    starts = [0]
    for n in batch.num_new_tokens:
        starts.append(starts[-1] + n)
    out: dict[int, list[TokenLogprobs]] = {}
    for r in rows:
        seq = batch.seqs[r]
        first = seq.num_computed_tokens  # position of the chunk's first token
        last = min(first + batch.num_new_tokens[r], len(seq.prompt_token_ids) - 1)  # positions [first, last)
        if last <= first:
            out[r] = []
            continue
        h = hidden[starts[r] : starts[r] + (last - first)]
        lp = torch.log_softmax(model.compute_logits(h, policy).float(), dim=-1)
        targets = torch.tensor(seq.prompt_token_ids[first + 1 : last + 1], device=lp.device)
        chosen = lp.gather(1, targets[:, None])
        ranks = (lp > chosen).sum(dim=-1) + 1
        top_n = min(seq.params.prompt_logprobs, lp.shape[1])
        top_v, top_i = lp.topk(top_n, dim=-1) if top_n else (lp[:, :0], lp[:, :0].long())
        values, ranks, top_v, top_i = chosen[:, 0].tolist(), ranks.tolist(), top_v.tolist(), top_i.tolist()
        out[r] = [
            [(t, v, rank)] + [(int(i), tv, k + 1) for k, (tv, i) in enumerate(zip(tvs, tis))]
            for t, v, rank, tvs, tis in zip(seq.prompt_token_ids[first + 1 : last + 1], values, ranks, top_v, top_i)
        ]
    return out
