"""The harness of the Triton CUDA kernel tests: the ``gpu`` marker, the kernel modules with
poisoned allocations (fixture ``K``), and the CUDA forms of kernel_cases' inputs.

The kernel modules' new tensors start as NaN (outputs) or junk (scratch, int buffers), so an
element a kernel forgets to write fails the check; errors are relative L2 against the
reference computed in fp32 from the same bf16 inputs (``TOL``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.ops.kernel_cases import paged as _paged
from tests.ops.kernel_cases import prefill_case as _prefill_case


def paged(lens, page, hkv, d, dtype, gen, extra_cols=2, device="cuda"):
    return _paged(lens, page, hkv, d, dtype, gen, extra_cols, device)


HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
BF16 = torch.bfloat16
TOL = 1e-2


def gpu(fn):
    fn = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")(fn)
    fn = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")(fn)
    return pytest.mark.cuda(fn)


class PoisonTorch:
    """``torch`` as seen by a kernel module: new tensors pre-filled with NaN / junk;
    counts allocations (proof that a dispatched op ran the Triton path)."""

    def __init__(self):
        self.allocs = 0

    def __getattr__(self, name):
        return getattr(torch, name)

    def _poison(self, t):
        self.allocs += 1
        return t.fill_(float("nan") if t.is_floating_point() else -77)

    def empty(self, *args, **kwargs):
        return self._poison(torch.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs):
        return self._poison(torch.empty_like(*args, **kwargs))


@pytest.fixture
def K(monkeypatch):
    """The kernel modules with poisoned allocations."""
    from ingot.ops.triton import (
        activation, decode_attention, kv_store, prefill_attention, prefill_dispatch, rms_norm, rotary, skinny_gemm,
    )

    mods = dict(activation=activation, decode_attention=decode_attention, kv_store=kv_store,
                prefill_attention=prefill_attention, prefill_dispatch=prefill_dispatch, rms_norm=rms_norm,
                rotary=rotary, skinny_gemm=skinny_gemm)
    poison = PoisonTorch()
    for mod in mods.values():
        monkeypatch.setattr(mod, "torch", poison)
    return type("Kernels", (), dict(mods, poison=poison))


def prefill_case(q_lens, ctx_lens, hq, hkv, d, page, gen, dtype=BF16):
    """Packed new tokens whose k/v are already stored in the cache; the op's arguments."""
    return _prefill_case(q_lens, ctx_lens, hq, hkv, d, page, gen, dtype, device="cuda", extra_cols=2)


def fp32(args):
    return [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
