"""The quantized parameters of a linear layer, and its GEMM: the canonical forms of
``ingot/loading/quant_scheme.py`` held as they load, multiplied by the ``int_linear`` /
``fp8_linear`` ops (on CUDA the kernels dequantize in registers; nothing keeps a
full-precision copy of the weight).

A ``MergedLinear`` with a scheme holds, instead of ``weight``: for ``IntWeights``
``qweight``, ``scales`` (+ ``zeros``, ``mins``, ``perm``); for ``Fp8Weights`` ``weight``
(float8) and ``weight_scale``. Every one of them but ``perm`` has the output rows first,
so the shards of a merged projection (q/k/v, gate/up) stack along rows like a dense
weight's, and a tensor-parallel rank takes its rows (column split) or its groups of
input columns (row split) of each.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ingot.loading.quant_scheme import Fp8Weights, IntWeights, LinearScheme


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: Optional[torch.device] = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def make_params(module: nn.Module, scheme: LinearScheme, out_features: int, in_features: int) -> None:
    """Register the scheme's parameters on ``module`` (uninitialised; scales in the default dtype
    until a checkpoint brings its own)."""
    if isinstance(scheme, IntWeights):
        if in_features % scheme.pack:
            raise ValueError(f"{in_features} input features do not pack into int32 words of {scheme.pack} values")
        groups = -(-in_features // scheme.group_size)
        module.qweight = _param((out_features, in_features // scheme.pack), torch.int32)
        module.scales = _param((out_features, groups), torch.get_default_dtype())
        module.zeros = _param((out_features, groups), torch.uint8) if scheme.has_zeros else None
        module.mins = _param((out_features, groups), torch.get_default_dtype()) if scheme.has_mins else None
        module.perm = _param((in_features,), torch.int64) if scheme.act_order else None
    else:
        module.weight = _param((out_features, in_features), torch.float8_e4m3fn)
        module.weight_scale = _param(scheme.grid(out_features, in_features), torch.float32)


# the parameters whose checkpoint dtype is kept (a float16 scale stays float16)
FLOAT_AS_STORED = ("scales", "mins")


def adopt_dtype(module: nn.Module, name: str, dtype: torch.dtype) -> None:
    """Before the first shard of ``name`` is copied in: hold it in the checkpoint's float dtype."""
    param = getattr(module, name)
    if name in FLOAT_AS_STORED and param.dtype != dtype and dtype.is_floating_point:
        setattr(module, name, _param(tuple(param.shape), dtype, param.device))


def input_columns(scheme: LinearScheme, name: str, first: int, count: int, in_features: int) -> Optional[slice]:
    """The columns of parameter ``name`` that hold input features [first, first + count) (a
    row-parallel rank's part); None when the parameter does not split by input column."""
    if isinstance(scheme, IntWeights):
        if name == "perm":
            raise ValueError("act-order (GPTQ desc_act) weights cannot be split by input columns across ranks")
        per = {"qweight": scheme.pack, "scales": scheme.group_size, "zeros": scheme.group_size, "mins": scheme.group_size}
    else:
        per = {"weight": 1, "weight_scale": scheme.block_k or in_features}
    unit = per[name]
    if first % unit or (count % unit and first + count != in_features):
        raise ValueError(f"a rank's input features [{first}, {first + count}) do not align with the {unit}-column "
                         f"{'groups' if name != 'qweight' else 'packed words'} of {name}")
    return slice(first // unit, -(-(first + count) // unit))


def output_rows(scheme: LinearScheme, name: str, first: int, count: int, out_features: int) -> Optional[slice]:
    """The rows of parameter ``name`` that hold outputs [first, first + count); None for ``perm``."""
    if name == "perm":
        return None
    if isinstance(scheme, Fp8Weights) and name == "weight_scale":
        bn = scheme.block_n or out_features
        if first % bn or (count % bn and first + count != out_features):
            raise ValueError(f"a rank's outputs [{first}, {first + count}) do not align with {bn}-row scale blocks")
        return slice(first // bn, -(-(first + count) // bn))
    return slice(first, first + count)


def quant_linear(module: nn.Module, scheme: LinearScheme, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x @ W.T (+ bias) for the module's quantized weight."""
    if isinstance(scheme, IntWeights):
        if module.perm is not None:
            x = x.index_select(-1, module.perm)
        return torch.ops.ingot.int_linear(x, module.qweight, module.scales, module.zeros, module.mins, bias,
                                          scheme.bits, scheme.group_size, scheme.default_zero)
    return torch.ops.ingot.fp8_linear(x, module.weight, module.weight_scale, bias, scheme.block_n, scheme.block_k,
                                      scheme.act_group)
