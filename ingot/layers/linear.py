"""Linear layers that load several HF projections into one fused weight.

Fusing q/k/v and gate/up into single GEMMs halves the launches of a decode
step. Each checkpoint shard is copied into its row range; a later
tensor-parallel split only has to narrow these ranges per rank.

Inputs of at most ``policy.skinny_rows`` rows (decode batches; 0 = never) go
through ``torch.ops.ingot.skinny_linear`` (a Triton GEMV on CUDA) instead of
``F.linear``; the model runner sets the row limit from
``EngineConfig.skinny_gemm_max_rows`` in the policy it gives each forward
(``layers/policy.py``). On that path ``norm_linear`` and ``silu_mul_linear``
also fold the RMSNorm or SiLU-and-mul in front of a projection into the GEMV's
load of its input (one launch instead of two), unless the policy keeps that op
native.

The norm is fused only into projections of at most ``NORM_PROLOGUE_MAX_N``
outputs: every N tile of the GEMV recomputes it over all of K, so a wide
projection pays it hundreds of times. H200, one row, each replayed alone
(``benchmarks/kernels.py``, ``kernels-2026-11-30-s5.json``): the qkv
projections gain (1.5B 5.18 fused vs 5.54 us norm + GEMV; 7B 9.36 vs 9.96),
the gate/up projections lose (1.5B 17.85 vs 16.38 us; 7B 69.10 vs 63.93).

Compiled decode keeps these ops as opaque nodes like every other ingot op
(``runner/inductor_fallbacks.py`` keeps Inductor's lowering of them fast).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from ingot.layers.activation import SiluAndMul
from ingot.layers.norm import RMSNorm
from ingot.layers.policy import DEFAULT_POLICY, OpPolicy

# widest projection (output features) that takes the norm in its GEMV: qkv yes, gate/up no
NORM_PROLOGUE_MAX_N = 8192


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, policy: OpPolicy = DEFAULT_POLICY
) -> torch.Tensor:
    """``F.linear``, or the skinny-GEMM op for inputs of at most ``policy.skinny_rows`` rows."""
    if policy.skinny(x):
        return torch.ops.ingot.skinny_linear(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


def norm_linear(
    x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, proj: "MergedLinear", policy: OpPolicy = DEFAULT_POLICY
) -> tuple[torch.Tensor, torch.Tensor]:
    """(proj(norm(x + residual)), x + residual), the norm fused into the GEMV on the skinny path
    (for projections of at most ``NORM_PROLOGUE_MAX_N`` outputs)."""
    if policy.skinny(x) and not policy.is_native("rms_norm") and proj.weight.shape[0] <= NORM_PROLOGUE_MAX_N:
        return torch.ops.ingot.rms_norm_linear(x, residual, norm.weight, norm.eps, proj.weight, proj.bias)
    h, residual = norm(x, residual, policy)
    return proj(h, policy), residual


def silu_mul_linear(x: torch.Tensor, act: SiluAndMul, proj: "MergedLinear", policy: OpPolicy = DEFAULT_POLICY) -> torch.Tensor:
    """proj(silu_and_mul(x)), the activation fused into the GEMV on the skinny path."""
    if policy.skinny(x) and not policy.is_native("silu_and_mul"):
        return torch.ops.ingot.silu_mul_linear(x, proj.weight, proj.bias)
    return proj(act(x, policy), policy)


class MergedLinear(nn.Module):
    """y = x @ W.T (+ b), where W stacks the rows of several named projections."""

    def __init__(self, in_features: int, shard_sizes: Sequence[int], bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.shard_sizes = tuple(shard_sizes)
        out = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features))
        self.bias = nn.Parameter(torch.zeros(out)) if bias else None

    def load_shard(self, param: str, index: int, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor (weight or bias of shard ``index``) into place."""
        start = sum(self.shard_sizes[:index])
        size = self.shard_sizes[index]
        target = getattr(self, param)
        if target is None or tensor.shape[0] != size:
            raise ValueError(f"{param} shard {index}: expected {size} rows, got {tuple(tensor.shape)}")
        target.data[start : start + size].copy_(tensor)

    def forward(self, x: torch.Tensor, policy: OpPolicy = DEFAULT_POLICY) -> torch.Tensor:
        return linear(x, self.weight, self.bias, policy)


def Linear(in_features: int, out_features: int, bias: bool = False) -> MergedLinear:
    """A plain projection: a merged linear with a single shard."""
    return MergedLinear(in_features, (out_features,), bias)
