"""Small host-side helpers shared by the Triton kernel modules (imports no triton)."""

from __future__ import annotations

import functools
import os

import torch


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
    """Streaming multiprocessors of ``device`` (132 for an H100/H200 off-GPU)."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last stride is 1 (row strides may be anything)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()
