"""The routed experts of a mixture-of-experts layer: stacked weights and one opaque op.

All experts of a layer live in two parameters, ``w_gate_up [E, 2I, H]`` (each
expert's gate rows, then its up rows) and ``w_down [E, H, I]``: the layout of
transformers' fused experts, and what ``torch.ops.ingot.fused_moe`` reads
(one launch sequence for the whole layer on CUDA instead of a loop over
experts). Checkpoints come with one tensor per expert and projection, with
the fused tensors, or (GGUF) with one stacked tensor per projection;
``load`` copies each into its place in the parameters, so the stacking
happens in device memory and the host never holds more than the tensor
being copied.

Under tensor parallelism each rank holds every expert's slice of the
intermediate features (``shard_range``): the gate/up rows and the down
columns of features ``[first, first + intermediate_size)``, so the op's output
is this rank's partial sum, which the MoE block all-reduces once (with its
shared expert's).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import ingot.ops  # noqa: F401  (registers torch.ops.ingot.*)
from ingot.distributed.parallel import SINGLE, TensorParallel, shard_range

# checkpoint projection -> (our parameter, shard: 0 = gate rows, 1 = up rows, None = whole)
PROJECTIONS = {
    "gate_proj": ("w_gate_up", 0),
    "up_proj": ("w_gate_up", 1),
    "down_proj": ("w_down", None),
    "gate_up_proj": ("w_gate_up", None),
}


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.tp = tp
        self.full_intermediate_size = intermediate_size
        self.first, intermediate_size = shard_range(intermediate_size, tp) if tp.enabled else (0, intermediate_size)
        self.intermediate_size = intermediate_size  # this rank's features of each expert
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def target(self, proj: str, expert: Optional[int]) -> torch.Tensor:
        """The slice of a parameter that checkpoint projection ``proj`` fills: one expert's rows
        (``expert`` given) or every expert's (a stacked tensor)."""
        name, shard = PROJECTIONS[proj]
        param = getattr(self, name).data
        if expert is not None:
            param = param[expert]
        if shard is not None:
            i = self.intermediate_size
            param = param.narrow(-2, shard * i, i)
        return param

    def checkpoint_slice(self, proj: str, expert: Optional[int]) -> Optional[tuple[slice, ...]]:
        """The part of a checkpoint tensor this rank reads: its rows of gate / up, its columns
        of down, of one expert ([I, H] / [H, I]) or stacked ([E, I, H] / [E, H, I]). None:
        the whole tensor (one rank; transformers' fused gate_up [E, 2I, H], cut in ``load``)."""
        if not self.tp.enabled or proj == "gate_up_proj":
            return None
        cut = slice(self.first, self.first + self.intermediate_size)
        lead = () if expert is not None else (slice(None),)
        return (*lead, slice(None), cut) if proj == "down_proj" else (*lead, cut)

    def load(self, proj: str, expert: Optional[int], tensor: torch.Tensor) -> list[str]:
        """Copy one checkpoint tensor (cut to ``checkpoint_slice``) into place; returns the keys
        it filled (``param#expert#shard``).

        Raises ValueError naming both shapes when the tensor does not fit.
        """
        if expert is not None and not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range (the model has {self.num_experts})")
        if proj == "gate_up_proj" and self.tp.enabled:  # whole [E, 2I, H]: this rank's rows of both halves
            i, n = self.full_intermediate_size, self.intermediate_size
            tensor = torch.cat([tensor.narrow(-2, self.first, n), tensor.narrow(-2, i + self.first, n)], dim=-2)
        dest = self.target(proj, expert)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != model shape {tuple(dest.shape)}")
        dest.copy_(tensor)
        name, shard = PROJECTIONS[proj]
        experts = [expert] if expert is not None else range(self.num_experts)
        shards = [shard] if shard is not None else ([0, 1] if name == "w_gate_up" else [0])
        return [f"{name}#{e}#{s}" for e in experts for s in shards]

    def expected_keys(self) -> set[str]:
        keys = {f"w_gate_up#{e}#{s}" for e in range(self.num_experts) for s in (0, 1)}
        return keys | {f"w_down#{e}#0" for e in range(self.num_experts)}

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, row_scale: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """hidden [T, H] through each token's experts ``topk_ids`` [T, k], weighted by ``topk_weights``
        (each row's gate/up sums times ``row_scale`` [T], when given: see ``norm_linear_scaled``)."""
        return torch.ops.ingot.fused_moe(hidden, self.w_gate_up, self.w_down, topk_weights, topk_ids, row_scale)
