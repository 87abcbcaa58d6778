"""Token embedding and the lm_head that maps hidden states to vocabulary logits.

Under tensor parallelism both are vocabulary-parallel: the vocabulary is padded
up to a multiple of the group size and each rank holds one contiguous slice of
rows (``padded_shard``; the padding rows are zero). The embedding looks up the
ids of its slice, zeroes the others and all-reduces (one rank contributes each
row); the lm_head computes the logits of its slice and all-gathers them, so
every rank ends with the full [tokens, vocab] logits (padding columns cut off).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ingot.distributed.collectives import all_gather_last_dim, all_reduce
from ingot.distributed.parallel import SINGLE, TensorParallel, padded_shard
from ingot.layers.linear import logits_linear
from ingot.layers.policy import DEFAULT_POLICY, OpPolicy


class VocabShard:
    """The rows [start, start + rows) of the vocabulary a rank holds (``vocab_size`` real ones)."""

    def __init__(self, vocab_size: int, tp: TensorParallel) -> None:
        self.vocab_size = vocab_size
        self.tp = tp
        self.start, self.rows = padded_shard(vocab_size, tp) if tp.enabled else (0, vocab_size)
        self.real_rows = max(0, min(self.rows, vocab_size - self.start))  # the rest is padding

    def checkpoint_slice(self) -> Optional[tuple[slice, ...]]:
        return (slice(self.start, self.start + self.real_rows),) if self.tp.enabled else None

    def load(self, weight: torch.Tensor, tensor: torch.Tensor) -> None:
        """Copy this rank's checkpoint rows (already cut to ``checkpoint_slice``) in; padding rows zero."""
        if tuple(tensor.shape) != (self.real_rows, weight.shape[1]):
            raise ValueError(f"expected {(self.real_rows, weight.shape[1])}, got {tuple(tensor.shape)}")
        weight.data[: self.real_rows].copy_(tensor)
        weight.data[self.real_rows :].zero_()


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.shard = VocabShard(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.shard.rows, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shard = self.shard
        if not shard.tp.enabled:
            return nn.functional.embedding(ids, self.weight)
        local = ids - shard.start
        outside = (local < 0) | (local >= shard.rows)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside[:, None], 0.0), shard.tp)


class LMHead(nn.Module):
    """Logits projection, in fp32 (``logits_linear``); shares the embedding matrix when the model ties them."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: Optional[Embedding], tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.shard = VocabShard(vocab_size, tp)
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(self.shard.rows, hidden_size))

    def forward(self, hidden: torch.Tensor, policy: OpPolicy = DEFAULT_POLICY) -> torch.Tensor:
        logits = logits_linear(hidden, self.weight, policy)
        if not self.shard.tp.enabled:
            return logits
        return all_gather_last_dim(logits, self.shard.tp)[..., : self.shard.vocab_size]
