"""The quantized fused-MoE kernels (fused_moe_int / fused_moe_fp8) through the Triton interpreter.

Gated by tests/ops/interpret_fixtures.py (``INGOT_TEST_TRITON_INTERPRET=1``), whose fixture
``K`` (the kernel modules imported afresh, allocations poisoned) this file reuses. Both paths
(per pair, grouped) at small shapes: int4 / int8 with and without zero points and mins, groups
of 16, 32, 128 and the whole row; fp8 per tensor, per row and in blocks, W8A16 and W8A8 per token /
per 128 columns, with the activations rounded in registers and on the fp8 dot; row scales; the
launch table's own choices. Mostly fp32 activations, where the kernels must match the reference
to 1e-5 (tests/ops/moe_quant_cases.py), a few bf16.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.interpret_fixtures import ENABLED, K  # noqa: F401  (K: the fixture)
from tests.ops.moe_quant_cases import check_quant_moe, fp8_moe_case, int_moe_case

pytestmark = pytest.mark.skipif(not ENABLED, reason="set INGOT_TEST_TRITON_INTERPRET=1 (needs triton)")
F32, BF16 = torch.float32, torch.bfloat16
CPU = torch.device("cpu")


def launch(K, path: str, h: int):
    """Tiles small enough for several N tiles and K steps at these shapes (hidden size ``h``),
    few enough for the interpreter."""
    L = K.fused_moe_quant.QuantMoeLaunch
    n = 16 if h < 256 else 64
    return {"per_pair": L(False, 1, (n, 2 * n, 4, 1), (n, 2 * n, 4, 1)),
            "grouped": L(True, 16, (n, n, 4, 1), (n, 2 * n, 4, 1)),
            "fp8_dot": L(True, 16, (n, n, 4, 1), (n, n, 4, 1), fp8_native=True, fp8_dot=True)}[path]


def assert_counters_zero():
    from ingot.ops.triton._common import _counters

    assert all(int(c.count_nonzero()) == 0 for c in _counters.values())


def row_scale(t: int) -> torch.Tensor:
    return torch.rand(t, generator=torch.Generator().manual_seed(t)) + 0.5


# (path, h, i, bits, group, zeros, mins, dtype, row scale)
INT_CASES = [
    ("per_pair", 64, 32, 4, 32, False, False, F32, True),  # GGUF Q4_0
    ("grouped", 64, 32, 4, 32, False, True, F32, False),  # GGUF Q4_1: mins, zero point 0
    ("per_pair", 64, 32, 8, 0, True, False, F32, False),  # int8 per row, zero points
    ("grouped", 64, 32, 8, 0, True, False, F32, True),
    ("per_pair", 256, 128, 4, 128, True, False, F32, False),  # AWQ-like g128: two groups of gate/up's K
    ("grouped", 256, 128, 4, 128, True, False, BF16, False),
    ("per_pair", 64, 32, 4, 32, False, True, BF16, True),
    ("grouped", 64, 32, 8, 16, False, True, F32, True),  # a Q4_K_M layer's experts in their common form: int8 g16
]


@pytest.mark.parametrize("path,h,i,bits,group,zeros,mins,dtype,scaled", INT_CASES)
def test_fused_moe_int(K, path, h, i, bits, group, zeros, mins, dtype, scaled):
    t = 5 if h < 256 else 3
    args = int_moe_case(t, 8, 2, h, i, bits, group, zeros, mins, dtype, torch.Generator().manual_seed(h + bits + group))
    cfg = launch(K, path, h)
    check_quant_moe(lambda *a, **kw: K.fused_moe_quant.fused_moe_int(*a, **kw, launch=cfg), args,
                    row_scale=row_scale(t) if scaled else None)
    assert_counters_zero()


# (path, h, i, block_n, block_k, act_group, dtype, row scale)
FP8_CASES = [
    ("per_pair", 64, 32, 0, 0, -1, F32, False),  # per tensor (one block per projection), W8A16
    ("grouped", 64, 32, 32, 32, -1, F32, True),  # 32 x 32 blocks, W8A16
    ("per_pair", 64, 32, 1, 0, 0, F32, True),  # per row, W8A8 per token (a first pass over each row)
    ("fp8_dot", 64, 32, 1, 0, 0, F32, False),  # the fp8 tensor-core GEMM
    ("per_pair", 256, 128, 128, 128, 128, F32, False),  # Qwen3 FP8: 128 x 128 blocks, W8A8 per 128 columns
    ("fp8_dot", 256, 128, 128, 128, 128, F32, True),
    ("grouped", 256, 128, 128, 128, 128, BF16, False),  # rounded in registers, bf16 dots
    ("per_pair", 64, 32, 32, 32, 32, BF16, False),
]


@pytest.mark.parametrize("path,h,i,block_n,block_k,act_group,dtype,scaled", FP8_CASES)
def test_fused_moe_fp8(K, path, h, i, block_n, block_k, act_group, dtype, scaled):
    t = 5 if h < 256 else 3
    args = fp8_moe_case(t, 8, 2, h, i, block_n, block_k, act_group, dtype, torch.Generator().manual_seed(h + block_n))
    cfg = launch(K, path, h)
    check_quant_moe(lambda *a, **kw: K.fused_moe_quant.fused_moe_fp8(*a, **kw, launch=cfg), args,
                    row_scale=row_scale(t) if scaled else None)
    assert_counters_zero()


def test_launch_table_and_edges(K):
    """The table's own launches (per pair at one token, grouped at many); zero tokens; groups no
    power-of-two tile aligns with (the reference)."""
    Q = K.fused_moe_quant
    assert not Q.launch_config(128, 768, 1, CPU).grouped and Q.launch_config(128, 768, 64, CPU).grouped
    assert Q.launch_config(128, 768, 1, CPU).gate_up == K.fused_moe_quant.dense.PER_PAIR_NARROW.gate_up
    assert not Q.launch_config(128, 768, 64, CPU, fp8=True).fp8_native  # the interpreter: bit decoding
    for t in (1, 12):
        args = int_moe_case(t, 16, 4, 32, 32, 4, 32, False, False, F32, torch.Generator().manual_seed(t))
        check_quant_moe(Q.fused_moe_int, args)
    args = int_moe_case(0, 8, 2, 64, 32, 4, 32, False, False, F32, torch.Generator().manual_seed(0))
    assert Q.fused_moe_int(*args).shape == (0, 64)
    args = int_moe_case(3, 8, 2, 96, 48, 4, 48, True, False, F32, torch.Generator().manual_seed(1))
    check_quant_moe(Q.fused_moe_int, args)
    args = fp8_moe_case(3, 8, 2, 96, 48, 1, 0, 48, F32, torch.Generator().manual_seed(2))
    check_quant_moe(Q.fused_moe_fp8, args)
