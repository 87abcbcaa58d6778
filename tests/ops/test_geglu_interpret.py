"""Gemma's GeGLU kernels through the Triton interpreter against the references: the gated
activation on its own and fused in front of the skinny GEMM (one row and a few, whole-K and
split K). Gated by tests/ops/interpret_fixtures.py, whose fixture ``K`` this file reuses."""

from __future__ import annotations

import pytest
import torch

from ingot.ops.reference_geglu import gelu_tanh_and_mul
from tests.ops.interpret_fixtures import ENABLED, K, skinny_config  # noqa: F401  (K: the fixture)
from tests.ops.kernel_cases import check_prologue_linear, rel_err

pytestmark = pytest.mark.skipif(not ENABLED, reason="set INGOT_TEST_TRITON_INTERPRET=1 (needs triton)")


@pytest.mark.parametrize("shape", [(7, 2 * 200), (2, 3, 2 * 64), (1, 2 * 1500)])
def test_gelu_tanh_and_mul(K, shape):
    """bf16 within rounding (the interpreter's casts to bf16 truncate), and fp32 to a few ulps:
    the sigmoid form of tanh is the reference's gelu, gates over +-6 (saturated both sides)."""
    gen = torch.Generator().manual_seed(7)
    x = 2 * torch.randn(*shape, generator=gen)
    out = K.activation.gelu_tanh_and_mul(x.to(torch.bfloat16))
    expected = gelu_tanh_and_mul(x.to(torch.bfloat16))
    assert out.shape == expected.shape and out.dtype == torch.bfloat16
    assert rel_err(out, expected) < 1e-2
    torch.testing.assert_close(K.activation.gelu_tanh_and_mul(x), gelu_tanh_and_mul(x), rtol=1e-6, atol=1e-6)


def test_silu_kernel_unchanged_by_the_activation_constexpr(K):
    from ingot.ops import reference as ref

    x = torch.randn(3, 2 * 96, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    assert rel_err(K.activation.silu_and_mul(x), ref.silu_and_mul(x)) < 1e-2


@pytest.mark.parametrize("m,n,k,bias,splits", [(1, 40, 96, True, None), (1, 24, 300, False, 3), (3, 33, 64, True, 2)])
def test_gelu_mul_linear(K, m, n, k, bias, splits):
    cfg = skinny_config(K, m, n, k, K.skinny_gemm.GELU_TANH, splits=splits)
    check_prologue_linear(K.skinny_gemm, "gelu", m, n, k, bias, torch.Generator().manual_seed(m + n + k), config=cfg)
