"""The gated activations over the merged gate/up projection: SiLU-and-mul (Llama) and
GeGLU, gelu (tanh approximation)-and-mul (Gemma)."""

from __future__ import annotations

import torch
from torch import nn

from ingot.layers.policy import DEFAULT_POLICY, OpPolicy
from ingot.ops import reference, reference_geglu


class SiluAndMul(nn.Module):
    """silu(x[..., :I]) * x[..., I:]. ``name``: its op, which the policy may keep native;
    ``fused``: the op that folds it into the next projection's GEMV (``linear.act_mul_linear``)."""

    name, fused = "silu_and_mul", "silu_mul_linear"

    @staticmethod
    def native(x: torch.Tensor) -> torch.Tensor:
        return reference.silu_and_mul(x)

    def forward(self, x: torch.Tensor, policy: OpPolicy = DEFAULT_POLICY) -> torch.Tensor:
        if policy.is_native(self.name):
            return self.native(x)
        return getattr(torch.ops.ingot, self.name)(x)


class GeluTanhAndMul(SiluAndMul):
    """gelu(x[..., :I], tanh approximation) * x[..., I:]: Gemma's GeGLU (HF's ``gelu_pytorch_tanh``)."""

    name, fused = "gelu_tanh_and_mul", "gelu_tanh_mul_linear"

    @staticmethod
    def native(x: torch.Tensor) -> torch.Tensor:
        return reference_geglu.gelu_tanh_and_mul(x)
