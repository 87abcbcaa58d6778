"""The GEMM-only reference of a decode step: every linear layer of the model, and nothing else.

A decode step can never be faster than its matrix products. Timing the same
linear layers (fused qkv, o, gate_up, down per layer, and lm_head) captured in
one CUDA graph at the same batch size gives that floor, so "step minus GEMMs"
is exactly the time spent in attention, norms, rotary, activations and glue:
the part ingot's kernels and the compile pass can still win back.
"""

from __future__ import annotations

import statistics

import torch
from torch import nn

from ingot.layers.linear import MergedLinear, linear
from ingot.layers.policy import OpPolicy
from ingot.runner.auto_compile import time_ms


def linear_weights(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, bias) of every projection a decode step multiplies by, lm_head last."""
    out = [(m.weight, m.bias) for m in model.modules() if isinstance(m, MergedLinear)]
    out.append((model.lm_head.weight, None))
    return out


@torch.inference_mode()
def gemm_only_ms(model: nn.Module, batch: int, policy: OpPolicy, iters: int = 30) -> float:
    """Median ms of all the model's GEMMs at ``batch`` rows (one graph replay on CUDA), routed
    as the model's forward routes them under ``policy`` (cuBLAS or the skinny GEMM)."""
    weights = linear_weights(model)
    ref = weights[0][0]
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=ref.dtype, device=ref.device) for w, _ in weights}

    def run() -> None:
        for w, b in weights:
            linear(inputs[w.shape[1]], w, b, policy)

    if ref.device.type != "cuda":
        return statistics.median(time_ms(run, iters, ref.device))
    run()  # cuBLAS handles and workspaces before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return statistics.median(time_ms(graph.replay, iters, ref.device))
