"""The routed-experts loop behind the fused-MoE references (``fused_moe``, ``fused_moe_int`` /
``fused_moe_fp8``, declared in reference.py), and the experts' optional epilogue: biases on
both projections and gpt-oss's clamped SwiGLU (``Epilogue``).

``reference.fused_moe``'s loop with each expert's weights dequantized when it is reached
(only the experts the routing touches, one at a time: nothing holds the layer dense), and,
for fp8 W8A8, each projection's input rounded through fp8 first (per token, or per token
and group of columns) as the kernels see it. Without that rounding the loop is the dense
one step for step, so a quantized layer equals the dense layer on its dequantized weights
exactly (fp32 models; bf16 ones too, same roundings). A leaf module: reference.py, which
owns the dequantization, hands each expert's weights in as functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

Expert = Callable[[int], torch.Tensor]  # expert id -> its dequantized [N, K] weight in the model dtype
Rounding = Callable[[torch.Tensor], torch.Tensor]  # activations -> their fp8 rounding, in fp32


@dataclass(frozen=True)
class Epilogue:
    """What an expert adds to the plain ``down(silu(gate) * up)``: per-expert biases on gate/up
    [E, 2I] and down [E, H] (None: none), and with ``alpha`` > 0 gpt-oss's clamped SwiGLU."""

    gate_up_bias: Optional[torch.Tensor] = None
    down_bias: Optional[torch.Tensor] = None
    alpha: float = 0.0
    limit: float = 0.0


PLAIN = Epilogue()


def activation(gate: torch.Tensor, up: torch.Tensor, alpha: float = 0.0, limit: float = 0.0) -> torch.Tensor:
    """``silu(gate) * up``; with ``alpha`` > 0 gpt-oss's clamped SwiGLU, as HF's
    ``GptOssExperts._apply_gate``: gate clamped above at ``limit``, up to [-limit, limit],
    ``(up + 1) * gate * sigmoid(gate * alpha)``."""
    if alpha <= 0:
        return torch.nn.functional.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def experts_loop(
    hidden: torch.Tensor, num_experts: int, gate_up: Expert, down: Expert, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, row_scale: Optional[torch.Tensor] = None, act: Optional[Rounding] = None,
    epilogue: Epilogue = PLAIN, every: Optional[bool] = None,
) -> torch.Tensor:
    """``reference.fused_moe`` over experts given as functions: ascending expert order, the
    routing weight applied in the model dtype, sums in fp32 rounded once; while a CUDA graph
    is being captured (or with ``every``) every expert runs on every token (weighted by zero
    where unrouted). Biases join each projection's output rounded to the model dtype, as HF adds them."""
    t, h = hidden.shape
    out = torch.zeros(t, h, dtype=torch.float32, device=hidden.device)
    if t == 0:
        return out.to(hidden.dtype)
    if every is None:
        every = hidden.is_cuda and torch.cuda.is_current_stream_capturing()
    ep = epilogue
    for e in range(num_experts) if every else torch.unique(topk_ids).tolist():
        if every:
            rows = torch.arange(t, device=hidden.device)
            weight = (topk_weights * (topk_ids == e)).sum(-1, keepdim=True)
        else:
            slot, rows = torch.where(topk_ids.T == e)  # slot-major, as the dense loop orders them
            weight = topk_weights[rows, slot, None]
        w13 = gate_up(e)
        sums = _project(hidden[rows], w13, act, None if row_scale is None else row_scale[rows])
        if ep.gate_up_bias is not None:
            sums = sums + ep.gate_up_bias[e]
        inter = w13.shape[0] // 2
        a = activation(sums[:, :inter], sums[:, inter:], ep.alpha, ep.limit)
        y = _project(a, down(e), act, None)
        if ep.down_bias is not None:
            y = y + ep.down_bias[e]
        y = y * weight
        out.index_put_((rows,), y.float(), accumulate=True)
    return out.to(hidden.dtype)


def _project(x: torch.Tensor, w: torch.Tensor, act: Optional[Rounding], row_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """x @ w.T rounded to x's dtype: the GEMM in the model dtype, or (a row scale, or fp8
    activations) in fp32 from the activations (rounded through fp8) and the weights, scaled."""
    if act is None and row_scale is None:
        return torch.nn.functional.linear(x, w)
    sums = torch.nn.functional.linear(x.float() if act is None else act(x), w.float())
    if row_scale is not None:
        sums = sums * row_scale[:, None]
    return sums.to(x.dtype)
