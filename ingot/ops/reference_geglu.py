"""GeGLU (Gemma's MLP activation) over the merged gate/up projection: references.

Declared like the ops of reference.py (``@op``), in a file of their own; the counterparts
of ``silu_and_mul`` and ``silu_mul_linear``, rounded the same way: the activation in fp32
rounded to the input dtype, then the product rounded (as HF's ``gelu_pytorch_tanh(gate) *
up`` in the model dtype).
"""

from __future__ import annotations

from typing import Optional

import torch

from ingot.ops.reference import _projected, op, skinny_linear


@op(fake=lambda x: x.new_empty(*x.shape[:-1], x.shape[-1] // 2))
def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu(x[..., :I], tanh approximation) * x[..., I:]."""
    half = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :half], approximate="tanh") * x[..., half:]


@op(fake=lambda x, weight, *_: _projected(x, weight))
def gelu_tanh_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """gelu_tanh_and_mul(x) projected by weight: the activation fused in front of the down projection."""
    return skinny_linear(gelu_tanh_and_mul(x), weight, bias)
