"""SiLU-and-mul over the merged gate/up projection."""

from __future__ import annotations

import torch
from torch import nn

from ingot.layers.policy import DEFAULT_POLICY, OpPolicy
from ingot.ops import reference


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor, policy: OpPolicy = DEFAULT_POLICY) -> torch.Tensor:
        if policy.is_native("silu_and_mul"):
            return reference.silu_and_mul(x)
        return torch.ops.ingot.silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu(x[..., :I], tanh approximation) * x[..., I:]: Gemma's GeGLU over the merged gate/up
    projection (HF's ``gelu_pytorch_tanh``)."""
    half = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :half], approximate="tanh") * x[..., half:]
