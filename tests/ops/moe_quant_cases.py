"""Inputs and checks shared by the quantized fused-MoE tests (reference, interpreter, GPU);
imports no Triton.

Experts are random canonical tensors stacked [E, ...] as FusedMoE holds them (each expert
from tests/ops/quant_cases.py's int / fp8 weights; fp8 gate and up with their own scale
blocks, gate's then up's). A kernel is checked against the reference op in fp32 on the same
inputs: fp32 outputs within 1e-5; others within ``tol`` or twice the reference's own
rounding in the model dtype (small shapes sum few terms, where one bf16 or fp8 rounding
weighs more), W8A8 also well below the distance between the W8A8 and W8A16 references (so
a kernel that skipped rounding its activations through fp8 fails).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ingot.ops import reference as ref
from tests.ops.kernel_cases import rel_err
from tests.ops.moe_cases import moe_inputs
from tests.ops.quant_cases import fp8_weight, int_weight


def int_experts(e: int, n: int, k: int, bits: int, group: int, zeros: bool, mins: bool, gen: torch.Generator,
                scale_dtype: torch.dtype = torch.float16) -> list[Optional[torch.Tensor]]:
    """(qweight, scales, zeros, mins) of ``e`` random [n, k] experts stacked (group 0: one per row)."""
    parts = [int_weight(n, k, bits, group or k, zeros, mins, gen, scale_dtype) for _ in range(e)]
    return [None if p[0] is None else torch.stack(p) for p in zip(*parts)]


def fp8_experts(e: int, n: int, k: int, block_n: int, block_k: int, projections: int,
                gen: torch.Generator) -> list[torch.Tensor]:
    """(weight, scale) of ``e`` experts of ``projections`` stacked [n / projections, k] fp8 weights,
    each projection with its own scale blocks (gate_up: gate's block rows, then up's)."""
    weights, scales = [], []
    for _ in range(e):
        parts = [fp8_weight(n // projections, k, block_n, block_k, gen) for _ in range(projections)]
        weights.append(torch.cat([w for w, _ in parts]))
        scales.append(torch.cat([s for _, s in parts]))
    return [torch.stack(weights), torch.stack(scales)]


def _routing(t: int, e: int, k: int, h: int, dtype: torch.dtype, gen: torch.Generator, routing: str,
             fp32_weights: bool) -> list[torch.Tensor]:
    """(hidden, topk_weights, topk_ids) on ``gen``'s device."""
    hidden, _, _, weights, ids = moe_inputs(t, e, k, h, 1, dtype, torch.Generator().manual_seed(gen.initial_seed()),
                                            routing, fp32_weights, device=str(gen.device))
    return [hidden, weights, ids]


def int_moe_case(t: int, e: int, k: int, h: int, i: int, bits: int, group: int, zeros: bool, mins: bool,
                 dtype: torch.dtype, gen: torch.Generator, routing: str = "random", fp32_weights: bool = False,
                 experts: Optional[tuple[list, list]] = None) -> list:
    """Arguments of ``fused_moe_int`` (``experts``: (gate_up, down) from ``int_experts`` to reuse).
    With mins the implicit zero point is 0, else 2 ** (bits - 1)."""
    gate_up, down = experts or (int_experts(e, 2 * i, h, bits, group, zeros, mins, gen),
                                int_experts(e, h, i, bits, group, zeros, mins, gen))
    hidden, weights, ids = _routing(t, e, k, h, dtype, gen, routing, fp32_weights)
    return [hidden, *gate_up, *down, weights, ids, bits, group, 0 if mins else 2 ** (bits - 1)]


def fp8_moe_case(t: int, e: int, k: int, h: int, i: int, block_n: int, block_k: int, act_group: int,
                 dtype: torch.dtype, gen: torch.Generator, routing: str = "random",
                 experts: Optional[tuple[list, list]] = None) -> list:
    """Arguments of ``fused_moe_fp8`` (``experts``: (gate_up, down) from ``fp8_experts`` to reuse)."""
    gate_up, down = experts or (fp8_experts(e, 2 * i, h, block_n, block_k, 2, gen),
                                fp8_experts(e, h, i, block_n, block_k, 1, gen))
    hidden, weights, ids = _routing(t, e, k, h, dtype, gen, routing, False)
    return [hidden, *gate_up, *down, weights, ids, block_n, block_k, act_group]


def is_fp8(args: list) -> bool:
    return args[1].dtype == torch.float8_e4m3fn


def reference(args: list, row_scale: Optional[torch.Tensor] = None, act_group: Optional[int] = None) -> torch.Tensor:
    """The reference op on ``args`` (``act_group``: another fp8 activation quantization)."""
    if is_fp8(args):
        return ref.fused_moe_fp8(*args[:9], args[9] if act_group is None else act_group, row_scale)
    return ref.fused_moe_int(*args, row_scale)


def fp32(args: list) -> list:
    """``args`` with the activations and routing weights in fp32 (the weights' tensors as they are)."""
    out = list(args)
    weights = 5 if is_fp8(args) else 9
    out[0], out[weights] = args[0].float(), args[weights].float()
    return out


def check_quant_moe(fn: Callable[..., torch.Tensor], args: list, tol: float = 1e-2,
                    row_scale: Optional[torch.Tensor] = None) -> float:
    """Run ``fn`` (a kernel of the op ``args`` are for) against the fp32 reference; the error."""
    return assert_near_reference(fn(*args, row_scale=row_scale), args, tol, row_scale)


def assert_near_reference(out: torch.Tensor, args: list, tol: float = 1e-2,
                          row_scale: Optional[torch.Tensor] = None) -> float:
    """``out``, the op's result on ``args``, against the fp32 reference: within ``tol`` or twice
    the reference's own error in the activations' dtype (W8A8 rounds activations to fp8, whose
    steps the fp32 reference's scales may split otherwise); the error."""
    hidden = args[0]
    assert out.dtype == hidden.dtype and out.shape == hidden.shape
    exact = reference(fp32(args), row_scale).to(out.device)
    err = rel_err(out, exact)
    if hidden.dtype == torch.float32:
        assert err < 1e-5, err
        return err
    own = rel_err(reference(args, row_scale).to(out.device), exact)
    assert err < max(tol, 2 * own), (err, own)
    if is_fp8(args) and args[9] >= 0 and hidden.shape[0]:
        gap = rel_err(reference(fp32(args), row_scale, act_group=-1).to(out.device), exact)
        assert err < 0.5 * gap, (err, gap)
    return err
