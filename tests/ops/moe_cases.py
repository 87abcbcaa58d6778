"""Inputs and checks shared by the fused_moe kernel tests (GPU and interpreter); imports no Triton."""

from __future__ import annotations

from typing import Callable

import torch

from tests.ops.kernel_cases import rel_err

ROUTINGS = ("random", "one_expert", "even")


def routing_ids(t: int, e: int, k: int, routing: str, gen: torch.Generator) -> torch.Tensor:
    """topk ids [T, k] (distinct per token): random top-k, every token on experts 0..k-1 (the first
    slot always expert 0, so one expert gets every token), or round-robin (each expert hit equally)."""
    if routing == "random":
        return torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]) if t else torch.zeros(0, k, dtype=torch.long)
    if routing == "one_expert":
        return torch.arange(k).repeat(t, 1)
    if routing == "even":
        return torch.arange(t * k).view(t, k) % e
    raise ValueError(routing)


def moe_inputs(t: int, e: int, k: int, h: int, i: int, dtype: torch.dtype, gen: torch.Generator,
               routing: str = "random", fp32_weights: bool = False, device: str = "cpu") -> list[torch.Tensor]:
    """(hidden, w_gate_up, w_down, topk_weights, topk_ids) with weights scaled so outputs stay O(1)."""
    hidden = torch.randn(t, h, generator=gen).to(dtype)
    w_gate_up = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(dtype)
    w_down = (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype)
    weights = torch.rand(t, k, generator=gen).softmax(-1)
    weights = weights if fp32_weights else weights.to(dtype)
    ids = routing_ids(t, e, k, routing, gen)
    return [x.to(device) for x in (hidden, w_gate_up, w_down, weights, ids)]


def check_fused_moe(fn: Callable[..., torch.Tensor], args: list[torch.Tensor], tol: float, rounding_tol: float = 2e-3) -> None:
    """``fn`` (a kernel) against the reference op computed in fp32 from the same inputs (within
    ``tol``), and against the reference in the inputs' own dtype, which rounds where the kernel
    does (within ``rounding_tol``: only the GEMMs' accumulation order differs). The references
    run on the inputs' device."""
    from ingot.ops import reference as ref

    out = fn(*args)
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    exact = ref.fused_moe(*[a.float() if a.is_floating_point() else a for a in args])
    err = rel_err(out.cpu(), exact.cpu())
    assert err < tol, f"relative error {err:.2e} against the fp32 reference"
    if args[0].dtype != torch.float32:
        err = rel_err(out.cpu(), ref.fused_moe(*args).cpu())
        assert err < rounding_tol, f"relative error {err:.2e} against the reference in {args[0].dtype}"


def expected_alignment(flat_ids: list[int], experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """The sorted pair list and block experts the align kernel must produce, spelled out."""
    pairs = len(flat_ids)
    sorted_ids: list[int] = []
    block_expert: list[int] = []
    for e in range(experts):
        mine = [p for p, x in enumerate(flat_ids) if x == e]
        if not mine:
            continue
        padded = -(-len(mine) // block_m) * block_m
        sorted_ids += mine + [pairs] * (padded - len(mine))
        block_expert += [e] * (padded // block_m)
    return sorted_ids, block_expert
