"""RMSNorm, optionally fused with the residual add that precedes it.

``x / rms(x) * w``; Gemma's ``(1 + w)`` norms are this one with ``1 + w`` folded into the
weight at load (``models/gemma.py``)."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from ingot.layers.policy import DEFAULT_POLICY, OpPolicy
from ingot.ops import reference


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, policy: OpPolicy = DEFAULT_POLICY
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Norm of ``x``; with ``residual``, returns (norm(x + residual), x + residual)."""
        native = policy.is_native("rms_norm")
        if residual is None:
            if native:
                return reference.rms_norm(x, self.weight, self.eps)
            return torch.ops.ingot.rms_norm(x, self.weight, self.eps)
        if native:
            return reference.add_rms_norm(x, residual, self.weight, self.eps)
        return torch.ops.ingot.add_rms_norm(x, residual, self.weight, self.eps)

