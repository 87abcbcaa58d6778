"""Token embedding and the lm_head that maps hidden states to vocabulary logits."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ingot.layers.linear import linear
from ingot.layers.policy import DEFAULT_POLICY, OpPolicy


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


class LMHead(nn.Module):
    """Logits projection; shares the embedding matrix when the model ties them."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: Optional[Embedding]) -> None:
        super().__init__()
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, hidden: torch.Tensor, policy: OpPolicy = DEFAULT_POLICY) -> torch.Tensor:
        return linear(hidden, self.weight, None, policy)
