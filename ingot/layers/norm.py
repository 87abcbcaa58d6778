"""RMSNorm, optionally fused with the residual add that precedes it."""

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


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + w)`` with the weight applied in fp32 and one cast at
    the end (Llama's casts the normed input first), as HF's Gemma2/Gemma3RMSNorm; the
    checkpoint holds ``w`` (zero-centred). Plain PyTorch: no fused op takes this rounding."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
