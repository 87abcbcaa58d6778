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

Quantized experts (a ``scheme``: one for every expert and projection of the layer) hold
the canonical forms of ``loading/quant_scheme.py`` stacked the same way, multiplied by
``fused_moe_int`` / ``fused_moe_fp8``: for ``IntWeights`` ``w_gate_up_qweight
[E, 2I, H * bits / 32]``, ``w_gate_up_scales [E, 2I, H / G]`` (+ ``_zeros``, ``_mins``)
and ``w_down_qweight [E, H, I * bits / 32]``, ``w_down_scales [E, H, I / G]``...; for
``Fp8Weights`` ``w_gate_up`` / ``w_down`` in float8 with ``w_gate_up_scale`` /
``w_down_scale``, whose block rows are gate's, then up's (``block_n`` 0: one block per
projection). A per-channel int group (``group_size`` >= the projection's K) is held as 0,
"one group per row", so gate/up and down share a scheme. They come one tensor per expert,
projection and part (``experts.3.gate_proj.qweight``); act-order permutations are accepted
only as the identity.

Optional per-expert biases (gpt-oss: ``w_gate_up_bias [E, 2I]``, gate's then up's, and
``w_down_bias [E, H]``) stay in the model dtype whatever the scheme, and ``swiglu``
(alpha, limit) selects gpt-oss's clamped SwiGLU for the activation; both ride in the
op's epilogue (``reference_quant.Epilogue``).

Under tensor parallelism each rank holds every expert's slice of the
intermediate features (``shard_range``): the gate/up rows and the down
columns of features ``[first, first + intermediate_size)``, so the op's output
is this rank's partial sum, which the MoE block all-reduces once (with its
shared expert's; down's bias is loaded on rank 0 only, zero elsewhere). Quantized, down's groups (and packed words, scale blocks) must not
straddle a rank's columns, nor gate/up's fp8 scale blocks its rows.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import torch
from torch import nn

import ingot.ops  # noqa: F401  (registers torch.ops.ingot.*)
from ingot.distributed.parallel import SINGLE, TensorParallel, shard_range
from ingot.loading.quant_scheme import Fp8Weights, IntWeights, LinearScheme

# checkpoint projection -> (our parameter, shard: 0 = gate rows, 1 = up rows, None = whole)
PROJECTIONS = {
    "gate_proj": ("w_gate_up", 0),
    "up_proj": ("w_gate_up", 1),
    "down_proj": ("w_down", None),
    "gate_up_proj": ("w_gate_up", None),
}
# a quantized module's canonical part -> the suffix of our parameter (fp8's weight: the parameter itself)
_SUFFIX = {"qweight": "_qweight", "scales": "_scales", "zeros": "_zeros", "mins": "_mins", "weight": "",
           "weight_scale": "_scale", "bias": "_bias"}


def stacked_scheme(projections: Mapping[tuple[Optional[LinearScheme], int, int], str]) -> Optional[LinearScheme]:
    """The one scheme FusedMoE holds for its experts' projections, given as (scheme, rows, input
    features) -> a name for errors. They must agree, up to int groups and fp8 scale blocks that
    span a projection's whole row or column (any such group holds it alike); a group spanning
    every projection's row is held as 0. Raises ValueError naming two that differ."""
    def spanned(s: Optional[LinearScheme], n: int, k: int) -> Optional[LinearScheme]:
        if isinstance(s, IntWeights):
            return dataclasses.replace(s, group_size=0 if s.group_size >= k else s.group_size)
        if isinstance(s, Fp8Weights):
            return dataclasses.replace(s, block_n=0 if s.block_n >= n else s.block_n, block_k=0 if s.block_k >= k else s.block_k)
        return s

    for candidate, _, _ in projections:
        if all(spanned(candidate, n, k) == spanned(s, n, k) for s, n, k in projections):
            return spanned(candidate, max(n for _, n, _ in projections), max(k for _, _, k in projections))
    (a, _, _), (b, _, _) = list(projections)[:2]
    first, second = list(projections.values())[:2]
    raise ValueError(f"{first} is held as {a or 'dense'} but {second} as {b or 'dense'}; ingot holds a layer's routed "
                     "experts (gate, up and down) in one scheme")


def _param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallel = SINGLE,
                 scheme: Optional[LinearScheme] = None, bias: bool = False,
                 swiglu: Optional[tuple[float, float]] = None) -> None:
        """``scheme`` (from ``stacked_scheme``): how every expert's weights are held (None: the
        model dtype); ``bias``: per-expert biases on both projections; ``swiglu``: (alpha, limit)
        of gpt-oss's clamped SwiGLU (None: silu(gate) * up). Raises ValueError where a rank's
        features do not align with its groups."""
        super().__init__()
        self.swiglu = swiglu or (0.0, 0.0)
        local = shard_range(intermediate_size, tp)[1] if tp.enabled else intermediate_size
        self.w_gate_up_bias = nn.Parameter(torch.zeros(num_experts, 2 * local)) if bias else None
        self.w_down_bias = nn.Parameter(torch.zeros(num_experts, hidden_size)) if bias else None
        self.num_experts = num_experts
        self.tp = tp
        self.full_intermediate_size = intermediate_size
        self.first, intermediate_size = shard_range(intermediate_size, tp) if tp.enabled else (0, intermediate_size)
        self.intermediate_size = intermediate_size  # this rank's features of each expert
        self.scheme = scheme
        self._adopted: set[str] = set()
        if scheme is None:
            self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
            self.w_down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
            return
        self._check_split(hidden_size)
        for name, (n, k, halves) in self._shapes(hidden_size).items():
            for part, (shape, dtype) in self._parts(n, k, halves).items():
                setattr(self, name + _SUFFIX[part], _param((num_experts, *shape), dtype))
        if isinstance(scheme, IntWeights):
            for name in ("w_gate_up", "w_down"):
                for part in ("zeros", "mins"):
                    if not hasattr(self, name + _SUFFIX[part]):
                        self.register_parameter(name + _SUFFIX[part], None)

    def _shapes(self, hidden: int) -> dict[str, tuple[int, int, int]]:
        """parameter -> (rows, input features, projections stacked by rows)."""
        return {"w_gate_up": (2 * self.intermediate_size, hidden, 2), "w_down": (hidden, self.intermediate_size, 1)}

    def _parts(self, n: int, k: int, halves: int) -> dict[str, tuple[tuple[int, int], torch.dtype]]:
        """The canonical parts of one expert's [n, k] weight of ``halves`` projections: shape, dtype."""
        s = self.scheme
        if isinstance(s, Fp8Weights):
            rows = halves * -(-(n // halves) // (s.block_n or n // halves))
            return {"weight": ((n, k), torch.float8_e4m3fn), "weight_scale": ((rows, -(-k // (s.block_k or k))), torch.float32)}
        if k % s.pack:
            raise ValueError(f"{k} input features do not pack into int32 words of {s.pack} values")
        groups = -(-k // s.group_size) if s.group_size else 1
        parts = {"qweight": ((n, k // s.pack), torch.int32), "scales": ((n, groups), torch.get_default_dtype())}
        if s.has_zeros:
            parts["zeros"] = ((n, groups), torch.uint8)
        if s.has_mins:
            parts["mins"] = ((n, groups), torch.get_default_dtype())
        return parts

    def _check_split(self, hidden: int) -> None:
        """Under tensor parallelism: a rank's features align with down's groups, packed words and
        scale blocks (its input columns) and with gate/up's scale blocks (its rows)."""
        if not self.tp.enabled:
            return
        s, first, n = self.scheme, self.first, self.intermediate_size
        units = {"packed words": s.pack, "groups": s.group_size} if isinstance(s, IntWeights) else {
            "scale blocks (columns)": s.block_k, "scale blocks (rows)": s.block_n}
        for what, unit in units.items():
            if 0 < unit < self.full_intermediate_size and (first % unit or n % unit):
                raise ValueError(f"a rank's expert features [{first}, {first + n}) do not align with the {unit}-wide "
                                 f"{what} of the quantized experts (tensor_parallel_size={self.tp.size})")

    def _name(self, proj: str, part: str) -> str:
        name = PROJECTIONS[proj][0]
        if part == "bias":
            if getattr(self, name + "_bias") is None:
                raise ValueError("the experts have no biases")
            return name + "_bias"
        if self.scheme is None:
            if part != "weight":
                raise ValueError(f"the experts are held in the model dtype: no quantized part {part!r}")
            return name
        if part not in _SUFFIX or getattr(self, name + _SUFFIX[part], None) is None:
            raise ValueError(f"{part}: not a parameter of the experts' {type(self.scheme).__name__} scheme")
        return name + _SUFFIX[part]

    def _rows(self, name: str) -> int:
        """Rows of one projection (shard) in parameter ``name``: its outputs, or its fp8 scale blocks."""
        rows = getattr(self, name).shape[1]
        return rows // 2 if name.startswith("w_gate_up") else rows

    def target(self, proj: str, expert: Optional[int], part: str = "weight") -> torch.Tensor:
        """The slice of a parameter that checkpoint projection ``proj`` (part ``part``) fills: one
        expert's rows (``expert`` given) or every expert's (a stacked tensor)."""
        name = self._name(proj, part)
        param = getattr(self, name).data
        if expert is not None:
            param = param[expert]
        shard = PROJECTIONS[proj][1]
        if shard is not None:
            rows = self._rows(name)
            param = param.narrow(-1 if part == "bias" else -2, shard * rows, rows)
        return param

    def checkpoint_slice(self, proj: str, expert: Optional[int], part: str = "weight") -> Optional[tuple[slice, ...]]:
        """The part of a checkpoint tensor this rank reads: its rows of gate / up, its columns
        of down, of one expert ([I, H] / [H, I]) or stacked ([E, I, H] / [E, H, I]); quantized,
        the rows or columns of each part that hold them. None: the whole tensor (one rank;
        transformers' fused gate_up [E, 2I, H], cut in ``load``)."""
        if not self.tp.enabled or proj == "gate_up_proj" or part == "perm" or (part, proj) == ("bias", "down_proj"):
            return None
        first, n = self.first, self.intermediate_size
        unit = 1
        if isinstance(self.scheme, IntWeights) and proj == "down_proj":
            unit = {"qweight": self.scheme.pack}.get(part, self.scheme.group_size)
        elif isinstance(self.scheme, Fp8Weights) and part == "weight_scale":
            unit = self.scheme.block_k if proj == "down_proj" else self.scheme.block_n
        if unit == 0 or unit >= self.full_intermediate_size:  # one scale for all the features: the whole of it
            return None
        cut = slice(first // unit, (first + n) // unit)
        lead = () if expert is not None else (slice(None),)
        return (*lead, slice(None), cut) if proj == "down_proj" else (*lead, cut)

    def load(self, proj: str, expert: Optional[int], tensor: torch.Tensor, part: str = "weight") -> list[str]:
        """Copy one checkpoint tensor (cut to ``checkpoint_slice``) into place; returns the keys
        it filled (``param#expert#shard``).

        Raises ValueError naming both shapes when the tensor does not fit.
        """
        if expert is not None and not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range (the model has {self.num_experts})")
        if self.scheme is not None and (expert is None or proj == "gate_up_proj") and part != "bias":
            raise ValueError("stacked or fused expert tensors cannot be held quantized (one tensor per expert and "
                             "projection is)")
        if part == "perm":
            if not torch.equal(tensor.cpu(), torch.arange(tensor.numel(), dtype=tensor.dtype)):
                raise ValueError("act-order (GPTQ desc_act) experts are not supported: the permutation is not the identity")
            return []
        if proj == "gate_up_proj" and self.tp.enabled:  # whole [E, 2I, H] ([E, 2I] bias): this rank's rows of both halves
            i, n, dim = self.full_intermediate_size, self.intermediate_size, -1 if part == "bias" else -2
            tensor = torch.cat([tensor.narrow(dim, self.first, n), tensor.narrow(dim, i + self.first, n)], dim=dim)
        if (part, proj) == ("bias", "down_proj") and not self.tp.is_driver:
            tensor = torch.zeros_like(tensor)  # the block's all-reduce adds rank 0's bias once
        name = self._name(proj, part)
        if part in ("scales", "mins") and name not in self._adopted:  # scales keep the checkpoint's float dtype
            self._adopted.add(name)
            param = getattr(self, name)
            if tensor.dtype.is_floating_point and param.dtype != tensor.dtype:
                setattr(self, name, nn.Parameter(torch.empty_like(param, dtype=tensor.dtype), requires_grad=False))
        dest = self.target(proj, expert, part)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != model shape {tuple(dest.shape)}")
        dest.copy_(tensor)
        shard = PROJECTIONS[proj][1]
        experts = [expert] if expert is not None else range(self.num_experts)
        shards = [shard] if shard is not None else ([0, 1] if name.startswith("w_gate_up") else [0])
        return [f"{name}#{e}#{s}" for e in experts for s in shards]

    def expected_keys(self) -> set[str]:
        keys: set[str] = set()
        for name, param in self.named_parameters():
            shards = (0, 1) if name.startswith("w_gate_up") else (0,)
            keys.update(f"{name}#{e}#{s}" for e in range(self.num_experts) for s in shards)
        return keys

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, row_scale: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """hidden [T, H] through each token's experts ``topk_ids`` [T, k], weighted by ``topk_weights``
        (each row's gate/up sums times ``row_scale`` [T], when given: see ``norm_linear_scaled``)."""
        s = self.scheme
        # the epilogue's arguments only where there is one: existing models call the ops as before
        extra = () if self.w_gate_up_bias is None and not self.swiglu[0] else (
            self.w_gate_up_bias, self.w_down_bias, *self.swiglu)
        if s is None:
            return torch.ops.ingot.fused_moe(hidden, self.w_gate_up, self.w_down, topk_weights, topk_ids, row_scale, *extra)
        if isinstance(s, IntWeights):
            return torch.ops.ingot.fused_moe_int(
                hidden, self.w_gate_up_qweight, self.w_gate_up_scales, self.w_gate_up_zeros, self.w_gate_up_mins,
                self.w_down_qweight, self.w_down_scales, self.w_down_zeros, self.w_down_mins, topk_weights, topk_ids,
                s.bits, s.group_size, s.default_zero, row_scale, *extra)
        return torch.ops.ingot.fused_moe_fp8(hidden, self.w_gate_up, self.w_gate_up_scale, self.w_down, self.w_down_scale,
                                             topk_weights, topk_ids, s.block_n, s.block_k, s.act_group, row_scale, *extra)
