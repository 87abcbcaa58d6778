"""OpPolicy: how the layers of one forward run their fusible ops.

Chosen by whoever builds the forward and passed down explicitly, never read
from process state: the model runner gives the raw forward the skinny-GEMM row
limit (0 without CUDA kernels), and the compiled decode forward gets the same
policy plus ``compile_native_ops``, so Inductor traces those ops' PyTorch form
and fuses it with the glue around them. A policy is frozen and each forward
keeps one instance, so what Dynamo guards on never changes between calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable

import torch


@dataclass(frozen=True)
class OpPolicy:
    # Linear inputs of at most this many rows (decode batches; 0 = never) go through
    # ``torch.ops.ingot.skinny_linear`` (a Triton GEMV on CUDA) instead of ``F.linear``,
    # with the RMSNorm / SiLU-and-mul before them fused into the GEMV's input load.
    skinny_rows: int = 0
    # Fusible ops (config.FUSIBLE_OPS) that run their PyTorch form instead of their opaque op.
    native: frozenset[str] = field(default_factory=frozenset)

    def is_native(self, op: str) -> bool:
        return op in self.native

    def skinny(self, x: torch.Tensor) -> bool:
        """Whether ``x`` takes the skinny-GEMM path."""
        return bool(self.skinny_rows) and x.dim() == 2 and x.shape[0] <= self.skinny_rows

    def with_native(self, ops: Iterable[str]) -> "OpPolicy":
        return replace(self, native=frozenset(ops))


DEFAULT_POLICY = OpPolicy()
