"""Small host-side helpers shared by the Triton kernel modules (imports no triton)."""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

# op name -> its CUDA kernel, filled as the kernel modules are imported (register_cuda_kernels)
CUDA_KERNELS: dict[str, Callable[..., Any]] = {}


def cuda_kernel(fn: F) -> F:
    """Mark ``fn`` as the CUDA implementation of ``torch.ops.ingot.<fn's name>``.

    Only recorded here: ``register_cuda_kernels`` registers it after its smoke test, so
    importing a kernel module (tests, benchmarks) changes no dispatch. ``fn`` takes the
    op's arguments in the op's order; extra ones (launch configs for tests and sweeps)
    need defaults, which the dispatcher leaves untouched.
    """
    CUDA_KERNELS[fn.__name__] = fn
    return fn


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (kernels run on CPU tensors through numpy).

    The interpreter mishandles ``tl.dot`` on bf16 operands, so kernels take a
    ``DOT_F32`` constexpr that upcasts dot operands there; on a GPU it is False.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (off-GPU: 132, the SM count the sm_90 launch tables were chosen at)."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """CUDA compute capability of ``device``; (0, 0) off-GPU (the interpreter)."""
    if device.type != "cuda":
        return (0, 0)
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last stride is 1 (row strides may be anything)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


# split counters: one int32 per output tile of a split-K kernel, shared by every kernel
# of a device (each launch leaves its counters at zero before it ends, and launches on
# one stream do not overlap)
_COUNTERS_MIN = 1 << 16
_counters: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, needed: int) -> "torch.Tensor | None":
    """Zeroed int32 counters of ``device`` (kept zero by the kernels), or None if too few
    exist and a CUDA graph capture is under way (allocating there would tie them to the graph).

    Kernels whose split programs finish with "the last one merges" bump one counter
    per output tile; the last program resets it. Two engines on one device driving
    kernels from different streams at once would share them: not supported.
    """
    have = _counters.get(device)
    if have is not None and have.numel() >= needed:
        return have
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    have = torch.zeros(max(needed, _COUNTERS_MIN), dtype=torch.int32, device=device)
    _counters[device] = have
    return have
