"""The skinny GEMM in the Triton interpreter against the reference ops: plain, with its norm
and SiLU prologues, and with a MoE layer's norm and router in its epilogue.
Gated by tests/ops/interpret_fixtures.py."""

from __future__ import annotations

import pytest
import torch

from ingot.ops import reference as ref
from tests.ops.interpret_fixtures import ENABLED, K, skinny_config  # noqa: F401  (K: the fixture)
from tests.ops.kernel_cases import check_linear_norm_router, check_prologue_linear, rel_err

pytestmark = pytest.mark.skipif(not ENABLED, reason="set INGOT_TEST_TRITON_INTERPRET=1 (needs triton)")


@pytest.mark.parametrize("m,n,k,bias,splits", [(1, 100, 96, True, None), (1, 100, 96, True, 2),
                                              (3, 64, 300, False, 3), (16, 130, 256, True, 2),
                                              (5, 17, 40, False, 1)])
def test_skinny_linear(K, m, n, k, bias, splits):
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    out = K.skinny_gemm.skinny_linear(x, w, b, config=skinny_config(K, m, n, k, splits=splits))
    expected = ref.skinny_linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert rel_err(out, expected) < 1e-2
    from ingot.ops.triton._common import _counters

    assert all(int(c.count_nonzero()) == 0 for c in _counters.values())  # left at zero


@pytest.mark.parametrize("m,splits", [(1, None), (1, 3), (4, 2)])
def test_skinny_linear_fp32_out(K, m, splits):
    """``out_dtype=float32`` (the logits): the fp32 sums stored unrounded, within fp32 summation
    order of the float64 product (a bf16 output would be off by ~1e-3)."""
    gen = torch.Generator().manual_seed(7 + m)
    x = torch.randn(m, 200, generator=gen).to(torch.bfloat16)
    w = torch.randn(70, 200, generator=gen).to(torch.bfloat16)
    out = K.skinny_gemm.skinny_linear(x, w, None, torch.float32, config=skinny_config(K, m, 70, 200, splits=splits))
    assert out.dtype == torch.float32 and out.shape == (m, 70)
    assert rel_err(out, x.double() @ w.double().T) < 1e-5


@pytest.mark.parametrize("prologue", ["norm", "norm_scaled", "silu"])
@pytest.mark.parametrize("m,n,k,bias,splits", [(1, 40, 96, True, None), (1, 24, 300, False, 3), (3, 33, 64, True, 2)])
def test_prologue_linear(K, prologue, m, n, k, bias, splits):
    """RMSNorm (also handing on its input in two factors) / SiLU-and-mul fused in front of the
    skinny GEMM, one row (multiply-reduce) and a few (tl.dot), whole-K programs and split K; a
    narrower prologue tile for the first case."""
    code = K.skinny_gemm.SILU if prologue == "silu" else K.skinny_gemm.NORM
    narrow = {"block_n": 16} if splits is None else {}
    cfg = skinny_config(K, m, n, k, code, splits=splits, **narrow)
    check_prologue_linear(K.skinny_gemm, prologue, m, n, k, bias, torch.Generator().manual_seed(m + n + k), config=cfg)


@pytest.mark.parametrize("m,n,k,experts,bias,fields", [
    (1, 64, 96, 8, False, {}), (1, 40, 300, 24, True, {"splits": 3}), (1, 48, 64, 128, False, {"splits": 1}),
    (1, 33, 200, 5, False, {"splits": 2, "block_n": 8}), (3, 40, 64, 6, True, {}), (3, 40, 300, 6, False, {"splits": 3}),
    (1, 88, 96, 6, False, {"block_n": 8, "share_block": 32}),  # 11 tiles' shares in rounds of 4, the last one short
    (1, 48, 320, 12, False, {"num_warps": 2, "waves": 8}),
])
def test_linear_norm_router(K, m, n, k, experts, bias, fields):
    """A projection joining the residual stream, then a MoE layer's norm and router, in one
    launch (one row: split K and whole-K tiles, a tile count the last tile's loop does not
    divide) and as two launches (more rows); the counters are left at zero."""
    cfg = skinny_config(K, m, n, k, router=True, **fields)
    check_linear_norm_router(K.skinny_gemm, m, n, k, experts, bias, torch.Generator().manual_seed(n + k), config=cfg)
    from ingot.ops.triton._common import _counters

    assert all(int(c.count_nonzero()) == 0 for c in _counters.values())
