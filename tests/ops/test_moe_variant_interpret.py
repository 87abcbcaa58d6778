"""gpt-oss's expert epilogue (biases on gate/up and down, the clamped SwiGLU) in the fused-MoE
kernels, dense and fp8 with MXFP4's 32-column scale blocks, through the Triton interpreter
against the references. Gated by tests/ops/interpret_fixtures.py, whose fixtures ``K`` and
``MOE`` this file reuses."""

from __future__ import annotations

import pytest
import torch

from ingot.ops import reference as ref
from tests.ops.interpret_fixtures import ENABLED, MOE, K  # noqa: F401  (the fixtures)
from tests.ops.kernel_cases import rel_err
from tests.ops.moe_cases import moe_inputs
from tests.ops.moe_quant_cases import fp8_moe_case

pytestmark = pytest.mark.skipif(not ENABLED, reason="set INGOT_TEST_TRITON_INTERPRET=1 (needs triton)")
ALPHA, LIMIT = 1.702, 0.5  # a small limit, so both clamps bite at these magnitudes


def epilogue(e: int, i: int, h: int, dtype: torch.dtype, seed: int, swiglu: bool = True) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(e, 2 * i, generator=gen) * 0.3).to(dtype), (torch.randn(e, h, generator=gen) * 0.3).to(dtype),
            ALPHA if swiglu else 0.0, LIMIT if swiglu else 0.0]


@pytest.mark.parametrize("grouped,dtype,swiglu", [
    (False, torch.float32, True), (True, torch.float32, True), (False, torch.bfloat16, True),
    (True, torch.bfloat16, True), (False, torch.float32, False),  # biases without the SwiGLU
])
def test_fused_moe_epilogue(MOE, grouped, dtype, swiglu):  # noqa: F811
    launch = MOE.MoeLaunch(True, 16, (16, 16, 4, 1), (16, 32, 4, 1)) if grouped else MOE.MoeLaunch(False, 1, (16, 32, 4, 1), (16, 16, 4, 1))
    t, e, k, h, i = 7, 4, 2, 48, 40
    args = moe_inputs(t, e, k, h, i, dtype, torch.Generator().manual_seed(3), routing="random")
    ep = epilogue(e, i, h, dtype, 4, swiglu)
    scale = torch.rand(t, generator=torch.Generator().manual_seed(5)) + 0.5
    for row_scale in (None, scale) if dtype == torch.float32 else (None,):
        out = MOE.run(*args, row_scale, launch=launch, epilogue=ref.Epilogue(*ep))
        exact = ref.fused_moe(*[a.float() for a in args[:4]], args[4], row_scale, *[x.float() for x in ep[:2]], *ep[2:])
        plain = ref.fused_moe(*[a.float() for a in args[:4]], args[4], row_scale)
        assert rel_err(plain, exact) > 0.05  # the epilogue changes the result
        if dtype == torch.float32:
            assert rel_err(out, exact) < 1e-5
        else:  # rounded where the reference rounds in bf16: only the GEMMs' order differs
            assert rel_err(out, ref.fused_moe(*args, row_scale, *ep)) < 1e-2
            assert rel_err(out, exact) < 2e-2


@pytest.mark.parametrize("path", ["per_pair", "grouped"])
def test_fused_moe_fp8_mxfp4_form(K, path):  # noqa: F811
    """fp8 experts with one scale per row and 32 columns (what MXFP4 converts into), biases and the
    clamped SwiGLU: the quantized kernels against the reference."""
    L = K.fused_moe_quant.QuantMoeLaunch
    # 64-column K tiles over K = 96 and 32: a tail tile of one scale block (gpt-oss's 2880 = 45 x 64)
    launch = L(False, 1, (16, 64, 4, 1), (16, 64, 4, 1)) if path == "per_pair" else L(True, 16, (16, 64, 4, 1), (16, 64, 4, 1))
    t, e, k, h, i = 5, 4, 2, 96, 32
    args = fp8_moe_case(t, e, k, h, i, 1, 32, -1, torch.float32, torch.Generator().manual_seed(9))
    ep = epilogue(e, i, h, torch.float32, 10)
    out = K.fused_moe_quant.fused_moe_fp8(*args, None, *ep, launch=launch)
    exact = ref.fused_moe_fp8(*args, None, *ep)
    assert rel_err(out, exact) < 1e-5
    assert rel_err(ref.fused_moe_fp8(*args), exact) > 0.05
