"""Linear layers that load several HF projections into one fused weight.

Fusing q/k/v and gate/up into single GEMMs halves the launches of a decode
step. Each checkpoint shard is copied into its row range.

Tensor parallelism (``tp``, ``split``): a ``"column"`` layer (qkv, gate/up)
holds this rank's rows of every shard, so its output is this rank's heads or
intermediate features and needs no communication; a ``"row"`` layer (o_proj,
down) holds this rank's columns, computes a partial sum and all-reduces it:
one all-reduce per row-parallel projection. Shards split in whole ``units``
(a head's rows); a shard with fewer units than ranks (KV heads under GQA) is
replicated. ``checkpoint_slice`` tells the loader which part of each
checkpoint tensor this rank reads, so a rank never holds a whole tensor it
does not own. A row-parallel bias is loaded on rank 0 only (zero elsewhere), so
the all-reduce adds it once.

Inputs of at most ``policy.skinny_rows`` rows (decode batches; 0 = never) go
through ``torch.ops.ingot.skinny_linear`` (a Triton GEMV on CUDA) instead of
``F.linear``; the model runner sets the row limit (1 with the Triton kernels,
else 0) in the policy it gives each forward (``layers/policy.py``). On that path ``norm_linear`` and ``act_mul_linear``
also fold the RMSNorm or SiLU / GeGLU-and-mul in front of a projection into the GEMV's
load of its input (one launch instead of two), unless the policy keeps that op
native; ``norm_linear_scaled`` also hands the normed input on, in two factors, to
a MoE block's experts, which read it after the router's GEMV, and
``linear_norm_linear_scaled`` puts that router's GEMV in the epilogue of the
projection before it (o_proj).

The norm is fused only into projections of at most ``NORM_PROLOGUE_MAX_N``
outputs: every N tile of the GEMV recomputes it over all of K, so a wide
projection pays it hundreds of times: at one row the qkv projections of 1.5B and
7B models gain about 6% (fused against norm + GEMV), their gate/up projections
lose about 8% (``python -m benchmarks.kernels`` measures both).

Compiled decode keeps these ops as opaque nodes like every other ingot op
(``runner/inductor_fallbacks.py`` keeps Inductor's lowering of them fast).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional, Sequence, Union

import torch
from torch import nn

from ingot.distributed.collectives import all_reduce
from ingot.distributed.parallel import SINGLE, TensorParallel, shard_range
from ingot.layers import quant_linear
from ingot.layers.activation import SiluAndMul
from ingot.layers.norm import RMSNorm
from ingot.layers.policy import DEFAULT_POLICY, OpPolicy
from ingot.loading.quant_scheme import Fp8Weights, IntWeights, LinearScheme

# widest projection (output features) that takes the norm in its GEMV: qkv yes, gate/up no
NORM_PROLOGUE_MAX_N = 8192


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, policy: OpPolicy = DEFAULT_POLICY
) -> torch.Tensor:
    """``F.linear``, or the skinny-GEMM op for inputs of at most ``policy.skinny_rows`` rows."""
    if policy.skinny(x):
        return torch.ops.ingot.skinny_linear(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


def logits_linear(x: torch.Tensor, weight: torch.Tensor, policy: OpPolicy = DEFAULT_POLICY) -> torch.Tensor:
    """``x @ weight.T`` in fp32: the logits keep their fp32 sums. Rounded to bf16 they tie or
    swap at gaps of one bf16 step (0.125 at a logit of 16), which the rows of one step and of
    another (a decode step's GEMV, a verify step's GEMM) round apart: greedy picks then differ
    between forwards that agree to their last bit of hidden state. The fp32 output costs its
    extra bytes only (4 a vocabulary entry instead of 2). Half-precision models on the CPU (no
    fp32-output GEMM there; an fp32 copy of the weight each step would cost more than the step)
    round their logits and upcast them."""
    if x.dtype == torch.float32:
        return linear(x, weight, None, policy)
    if policy.skinny(x):
        return torch.ops.ingot.skinny_linear(x, weight, None, torch.float32)
    if x.is_cuda:
        rows = x.reshape(-1, x.shape[-1])
        return torch.mm(rows, weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], weight.shape[0])
    return nn.functional.linear(x, weight).float()


def norm_linear(
    x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, proj: "MergedLinear", policy: OpPolicy = DEFAULT_POLICY
) -> tuple[torch.Tensor, torch.Tensor]:
    """(proj(norm(x + residual)), x + residual), the norm fused into the GEMV on the skinny path
    (for projections of at most ``NORM_PROLOGUE_MAX_N`` outputs)."""
    if _fuses_norm(x, proj, policy):
        out, residual = torch.ops.ingot.rms_norm_linear(x, residual, norm.weight, norm.eps, proj.weight, proj.bias)
        return proj.reduce(out), residual
    h, residual = norm(x, residual, policy)
    return proj(h, policy), residual


def norm_linear_scaled(
    x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, proj: "MergedLinear", policy: OpPolicy = DEFAULT_POLICY
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(proj(h), x + residual, hw, scale) with h = norm(x + residual) = hw * scale up to
    rounding: ``norm_linear`` for a block whose experts also read h (a MoE layer). On the
    skinny path the GEMV writes hw = norm_w * (x + residual) and each row's rstd as it goes,
    and the experts scale their sums by it (``fused_moe``'s ``row_scale``): the norm's own
    launch goes. Otherwise hw = h and scale is None."""
    if _fuses_norm(x, proj, policy):
        out, residual, hw, rstd = torch.ops.ingot.rms_norm_linear_scaled(
            x, residual, norm.weight, norm.eps, proj.weight, proj.bias)
        return proj.reduce(out), residual, hw, rstd
    h, residual = norm(x, residual, policy)
    return proj(h, policy), residual, h, None


def linear_norm_linear_scaled(
    x: torch.Tensor, proj: "MergedLinear", residual: torch.Tensor, norm: RMSNorm, router: "MergedLinear",
    policy: OpPolicy = DEFAULT_POLICY,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``norm_linear_scaled(proj(x), residual, norm, router)``: a projection joining the residual
    stream (attention's o_proj), then a MoE layer's norm and router. On the skinny path, one
    op: for one row one launch, the router's GEMV riding in the projection's (each tile adds
    its share of the router's sums; the last tile adds them up). Not under tensor parallelism,
    where the projection's output is summed over ranks first."""
    if _fuses_norm(x, router, policy) and proj.scheme is None and not proj.all_reduce and router.bias is None:
        return torch.ops.ingot.linear_norm_linear_scaled(
            x, proj.weight, proj.bias, residual, norm.weight, norm.eps, router.weight)
    return norm_linear_scaled(proj(x, policy), residual, norm, router, policy)


def _fuses_norm(x: torch.Tensor, proj: "MergedLinear", policy: OpPolicy) -> bool:
    """Whether the norm in front of ``proj`` folds into its GEMV (skinny rows, the norm not
    kept native, at most ``NORM_PROLOGUE_MAX_N`` outputs)."""
    return (policy.skinny(x) and proj.scheme is None and not policy.is_native("rms_norm")
            and proj.weight.shape[0] <= NORM_PROLOGUE_MAX_N)


def act_mul_linear(x: torch.Tensor, act: SiluAndMul, proj: "MergedLinear", policy: OpPolicy = DEFAULT_POLICY) -> torch.Tensor:
    """proj(act(x)) for a gated activation (SiLU or GeGLU and mul), the activation fused into
    the GEMV on the skinny path (its ``act.fused`` op)."""
    if policy.skinny(x) and proj.scheme is None and not policy.is_native(act.name):
        return proj.reduce(getattr(torch.ops.ingot, act.fused)(x, proj.weight, proj.bias))
    return proj(act(x, policy), policy)


Split = Literal["none", "column", "row"]


class MergedLinear(nn.Module):
    """y = x @ W.T (+ b), where W stacks the rows of several named projections.

    ``shard_sizes`` are the checkpoint's (whole-model) sizes; under tensor
    parallelism the layer holds this rank's part (``local_sizes``, ``in_features``).
    With a ``scheme`` the weight is held quantized (``quant_linear.py``).
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: Sequence[int],
        bias: bool = False,
        *,
        tp: TensorParallel = SINGLE,
        split: Split = "none",
        units: Union[int, Sequence[int]] = 1,
        reduce: bool = True,
        scheme: Optional[LinearScheme] = None,
    ) -> None:
        super().__init__()
        self.tp = tp if split != "none" else SINGLE
        self.split = split if self.tp.enabled else "none"
        self.all_reduce = self.split == "row" and reduce  # False: the caller reduces a sum of partial outputs
        self.shard_sizes = tuple(shard_sizes)
        unit_sizes = tuple(units) if isinstance(units, Sequence) else (units,) * len(self.shard_sizes)
        # per shard: (first checkpoint row, rows) this rank holds
        self.row_ranges = tuple((0, size) for size in self.shard_sizes)
        self.col_range = (0, in_features)
        if self.split == "column":
            ranges = []
            for size, unit in zip(self.shard_sizes, unit_sizes):
                first, count = shard_range(size // unit, self.tp, replicate=True)
                ranges.append((first * unit, count * unit))
            self.row_ranges = tuple(ranges)
        elif self.split == "row":
            (unit,) = set(unit_sizes)
            first, count = shard_range(in_features // unit, self.tp)
            self.col_range = (first * unit, count * unit)
        self.local_sizes = tuple(rows for _, rows in self.row_ranges)
        self.in_features = self.col_range[1]
        out = sum(self.local_sizes)
        if isinstance(scheme, Fp8Weights) and scheme.block_n == 0:
            # one scale per tensor cannot stack the shards of a merged projection: one per row instead
            scheme = Fp8Weights(1, scheme.block_k, scheme.act_group)
        if isinstance(scheme, IntWeights) and scheme.group_size == 0:  # one group per row, whatever its width
            scheme = dataclasses.replace(scheme, group_size=in_features)
        self.scheme = scheme
        self._adopted: set[str] = set()
        if scheme is None:
            self.weight = nn.Parameter(torch.empty(out, self.in_features))
        else:
            quant_linear.make_params(self, scheme, out, self.in_features)
        self.bias = nn.Parameter(torch.zeros(out)) if bias else None

    def checkpoint_slice(self, param: str, index: int) -> Optional[tuple[slice, ...]]:
        """The part of checkpoint tensor ``param`` of shard ``index`` this rank reads (None: all of it)."""
        if self.split == "column":
            first, rows = self.row_ranges[index]
            if self.scheme is not None and param != "bias":
                rows_slice = quant_linear.output_rows(self.scheme, param, first, rows, self.shard_sizes[index])
                return None if rows_slice is None else (rows_slice,)
            return (slice(first, first + rows),)
        if self.split == "row" and param != "bias":
            first, cols = self.col_range
            if self.scheme is not None:
                whole = self.col_range[1] * self.tp.size  # the checkpoint's input features (equal split)
                return (slice(None), quant_linear.input_columns(self.scheme, param, first, cols, whole))
            return (slice(None), slice(first, first + cols))
        return None

    def split_stacked(self, param: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """A checkpoint tensor holding every shard's rows (Phi-3's ``qkv_proj``, ``gate_up_proj``)
        as the per-shard tensors ``load_shard`` takes (each cut to ``checkpoint_slice``)."""
        total = sum(self.shard_sizes)
        if (self.scheme is None or param == "bias") and tensor.shape[0] != total:
            raise ValueError(f"{param}: expected {total} rows (the shards {self.shard_sizes} stacked), "
                             f"got {tuple(tensor.shape)}")
        parts = []
        for index, size in enumerate(self.shard_sizes):
            first = sum(self.shard_sizes[:index])
            rows = (slice(first, first + size) if self.scheme is None or param == "bias"
                    else quant_linear.output_rows(self.scheme, param, first, size, total))
            part = tensor if rows is None else tensor[rows]
            cut = self.checkpoint_slice(param, index)
            parts.append(part if cut is None else part[cut])
        return parts

    def load_shard(self, param: str, index: int, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor (weight or bias of shard ``index``, already cut to
        ``checkpoint_slice``; or a quantized layer's parameter) into place."""
        if self.scheme is not None and param != "bias":
            return self._load_quantized(param, index, tensor)
        start = sum(self.local_sizes[:index])
        size = self.local_sizes[index]
        target = getattr(self, param)
        if target is None or tensor.shape[0] != size or tensor.shape[1:] != target.shape[1:]:
            raise ValueError(f"{param} shard {index}: expected {(size, *target.shape[1:]) if target is not None else size}, "
                             f"got {tuple(tensor.shape)}")
        if self.split == "row" and param == "bias" and not self.tp.is_driver:
            tensor = torch.zeros_like(tensor)  # the all-reduce adds rank 0's bias once
        target.data[start : start + size].copy_(tensor)

    def _load_quantized(self, param: str, index: int, tensor: torch.Tensor) -> None:
        """A quantized parameter of shard ``index``: its rows into place (``perm``, the input
        columns' order, is one for every shard: they share their input)."""
        target = getattr(self, param, None)
        if target is None:
            raise ValueError(f"{param}: not a parameter of this layer's {type(self.scheme).__name__} scheme")
        if param == "perm":
            if index and not torch.equal(target.data, tensor.to(target.device)):
                raise ValueError("the shards of a merged projection have different act-order permutations")
            target.data.copy_(tensor)
            return
        if param not in self._adopted:  # the first shard to arrive (any index) sets a float param's dtype
            self._adopted.add(param)
            quant_linear.adopt_dtype(self, param, tensor.dtype)
            target = getattr(self, param)
        rows = quant_linear.output_rows(self.scheme, param, sum(self.local_sizes[:index]), self.local_sizes[index],
                                        sum(self.local_sizes))
        if param == "weight_scale" and self.scheme.block_n == 1 and tensor.shape[0] == 1:
            tensor = tensor.expand(rows.stop - rows.start, tensor.shape[1])  # a per-tensor scale, per row
        if tensor.shape[0] != rows.stop - rows.start or tensor.shape[1:] != target.shape[1:]:
            raise ValueError(f"{param} shard {index}: expected {(rows.stop - rows.start, *target.shape[1:])}, "
                             f"got {tuple(tensor.shape)}")
        target.data[rows].copy_(tensor)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output from this rank's GEMM: the sum over ranks for a row-parallel layer."""
        return all_reduce(y, self.tp) if self.all_reduce else y

    def forward(self, x: torch.Tensor, policy: OpPolicy = DEFAULT_POLICY) -> torch.Tensor:
        if self.scheme is not None:
            return self.reduce(quant_linear.quant_linear(self, self.scheme, x, self.bias))
        return self.reduce(linear(x, self.weight, self.bias, policy))


def Linear(in_features: int, out_features: int, bias: bool = False, *, tp: TensorParallel = SINGLE,
           split: Split = "none", units: int = 1, reduce: bool = True, scheme: Optional[LinearScheme] = None) -> MergedLinear:
    """A plain projection: a merged linear with a single shard."""
    return MergedLinear(in_features, (out_features,), bias, tp=tp, split=split, units=units, reduce=reduce, scheme=scheme)
