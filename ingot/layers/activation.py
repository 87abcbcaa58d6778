"""SiLU-and-mul over the merged gate/up projection."""

from __future__ import annotations

import torch
from torch import nn

from ingot.ops import reference, use_native


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_native("silu_and_mul"):
            return reference.silu_and_mul(x)
        return torch.ops.ingot.silu_and_mul(x)
