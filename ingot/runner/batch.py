"""ScheduledBatch: what the engine asks the runner to compute in one step.

The runner reads a sequence only through ``BatchSequence``: its tokens, its
progress, its KV block ids and how to sample it. The engine's ``Sequence``
satisfies it; the runner never imports the engine.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

import torch

from ingot.runner.sampler import TokenMask
from ingot.sampling_params import SamplingParams


class BatchSequence(Protocol):
    """The fields of one sequence that a step reads."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    generator: Optional[torch.Generator]
    block_ids: array.array  # int32 KV block ids, in token order
    num_computed_tokens: int  # tokens whose KV is already cached
    # speculative decoding with a draft model: its leading tokens whose draft K/V is in the
    # draft's pool; fewer than ``num_computed_tokens`` where the draft sat out steps (or a
    # prefix-cache hit brought the target's K/V alone), or by the last draft of a round that
    # kept every draft (proposed, never fed)
    draft_kv_len: int

    @property
    def num_tokens(self) -> int: ...

    def tokens(self, start: int, end: int) -> list[int]: ...


@dataclass
class ScheduledBatch:
    """One step: all-prefill (chunks of any length) or all-decode (one token per sequence)."""

    seqs: list[BatchSequence]
    is_prefill: bool
    num_new_tokens: list[int] = field(default_factory=list)  # tokens computed per seq this step
    # Structured outputs: called once the step's forward is queued and before it samples, with
    # the batch rows that sample (in logits order); the allowed tokens of those with a grammar
    # (``TokenMask.rows`` index that list). The engine computes it on the host meanwhile.
    # (sampling rows, the verify step's drafts per row or None) -> the grammar rows' mask
    token_mask: Optional[Callable[[list[int], Optional[list[list[int]]]], Optional[TokenMask]]] = None
    # Speculative decoding: a verify step (a decode step whose sequences also feed their drafted
    # tokens, ``num_new_tokens[i] = 1 + len(draft_tokens[i])``), run as one decode row per
    # token (``step_inputs._verify_step``); every sequence samples (``runner/spec_verify.py``).
    # None: a plain step.
    draft_tokens: Optional[list[list[int]]] = None
    # A draft model's distribution each draft of a sampled row was drawn from, per verify
    # position ([sum(len(d) + 1), V'], set with the drafts: ``runner/draft_runner.py``); None:
    # every draft a point mass (n-gram drafts, greedy rows).
    draft_probs: Optional[torch.Tensor] = None
    # A draft model runs on this plain step too (its K/V of the step's tokens, each row's missing
    # draft K/V caught up first: ``runner/draft_runner.py``), as the engine decided
    # (``DraftModelSpeculator.plan``). A verify step's draft round runs whatever this says.
    draft_follows: bool = False

    def samples(self, i: int) -> bool:
        """Does row i produce a token this step (its computation reaches its last token)?"""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens


def draft_kv_lag(seq: BatchSequence) -> int:
    """The tokens before ``seq``'s next one whose draft K/V is missing (0: none)."""
    return seq.num_computed_tokens - seq.draft_kv_len
