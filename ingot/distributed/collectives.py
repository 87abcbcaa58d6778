"""The collectives of tensor parallelism, over the group of a ``TensorParallel``.

The model's collectives (``all_reduce``, ``all_gather_last_dim``) are the
functional ones (``torch.ops._c10d_functional``): they return new tensors, so
Dynamo traces them into the compiled decode forward, and on CUDA they run NCCL
kernels that a decode CUDA graph captures. Without tensor parallelism they are
the identity. The runner's collectives (``broadcast_``, ``broadcast_object``,
``min_over_ranks``) are plain c10d calls, never inside a graph.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ingot.distributed.parallel import TensorParallel

_funcol = torch.ops._c10d_functional


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum of ``x`` over the ranks (the output of a row-parallel projection)."""
    if not tp.enabled:
        return x
    return _funcol.wait_tensor(_funcol.all_reduce(x, "sum", tp.group_name))


def all_gather_last_dim(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Every rank's ``x`` [..., n] side by side in rank order: [..., size * n]
    (the vocabulary slices of the lm_head)."""
    if not tp.enabled:
        return x
    stacked = _funcol.wait_tensor(_funcol.all_gather_into_tensor(x.contiguous(), tp.size, tp.group_name))
    # [size * rows, n] -> [rows, size, n] -> [rows, size * n]
    rows = x.shape[:-1]
    return stacked.view(tp.size, *rows, x.shape[-1]).movedim(0, -2).reshape(*rows, tp.size * x.shape[-1])


def broadcast_(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Rank 0's ``x`` into every rank's ``x``, in place (the step inputs)."""
    if tp.enabled:
        dist.broadcast(x, src=0)
    return x


def broadcast_object(obj: Any, tp: TensorParallel) -> Any:
    """Rank 0's picklable ``obj`` (the other ranks pass None); control messages only."""
    if not tp.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def min_over_ranks(value: int, tp: TensorParallel, device: torch.device) -> int:
    """The smallest ``value`` of any rank (KV blocks every rank can hold; a choice every rank agrees to)."""
    if not tp.enabled:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
