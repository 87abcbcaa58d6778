"""The int_linear / fp8_linear Triton kernels run on CPU through the Triton interpreter.

Gated by tests/ops/interpret_fixtures.py (``INGOT_TEST_TRITON_INTERPRET=1``), whose
fixture ``K`` (the kernel modules imported afresh, allocations poisoned) this file reuses.
Every path at small shapes: the one-row GEMV, the tl.dot GEMV, the tiled GEMM; int4 and
int8 with groups of 16, 32, 128 and the whole row (fp16 or fp32 scales), zero points and mins on and off, bias, K
not a multiple of the tile; fp8 per tensor, per channel and in 128 x 128 blocks, W8A16 and
W8A8 (per token, per 128 columns) by every W8A8 route (rounding in registers, the fp8 dot
GEMM, torch._scaled_mm). Against the fp32 reference (tests/ops/quant_cases.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.ops.interpret_fixtures import ENABLED, K  # noqa: F401  (K: the fixture)
from tests.ops.quant_cases import check_fp8_linear, check_int_linear, fp8_case, int_case

pytestmark = pytest.mark.skipif(not ENABLED, reason="set INGOT_TEST_TRITON_INTERPRET=1 (needs triton)")
CPU = torch.device("cpu")
BF16 = torch.bfloat16


def int_config(K, m, n, k, group, **fields):
    """The launch table's configuration with small tiles (several per row, short K splits)."""
    cfg = K.int_linear.launch_config(m, n, k, group, CPU)
    small = dict(block_n=16, block_k=64) if cfg.gemv else dict(block_m=32, block_n=16, block_k=32)
    return replace(cfg, **{**small, **fields})


def assert_counters_zero():
    from ingot.ops.triton._common import _counters

    assert all(int(c.count_nonzero()) == 0 for c in _counters.values())


# (m, n, k, bits, group, zeros, mins, bias, fields): GEMV one row, GEMV tl.dot, GEMM
INT_CASES = [
    (1, 40, 256, 4, 128, False, False, True, {}),  # AWQ/GPTQ-like g128, split K
    (1, 24, 200, 4, 32, True, False, False, {"splits": 1}),  # GGUF g32 (groups smaller than the tile), K tail
    (1, 33, 136, 8, 136, True, False, True, {"splits": 2}),  # int8 per channel, K not a power of two
    (1, 20, 160, 4, 32, False, True, False, {}),  # Q4_1: mins, zero point 0
    (1, 16, 256, 8, 128, False, False, False, {"block_k": 256}),  # tile spanning two groups
    (3, 40, 256, 4, 128, True, False, True, {}),
    (5, 30, 96, 8, 32, False, True, False, {"splits": 1}),
    (4, 24, 192, 4, 64, False, True, True, {}),  # one group per K tile with mins: the dot's sums scaled
    (16, 24, 264, 4, 264, False, False, False, {}),  # channel, rows = 16
    (1, 40, 256, 4, 128, True, False, True, {"use_dot": True}),  # one row on tl.dot
    (40, 40, 256, 4, 128, True, True, True, {}),  # GEMV, rows padded to 64
    (20, 40, 256, 4, 128, False, False, True, {"gemv": False}),  # GEMM
    (37, 33, 200, 4, 32, True, True, False, {"gemv": False, "block_k": 64}),  # GEMM, two groups per K tile, tails
    (40, 20, 136, 8, 136, True, False, True, {"gemv": False}),  # GEMM, int8 channel
    (65, 20, 136, 8, 136, True, False, True, {}),  # GEMM: the table's choice above 64 rows
    (1, 24, 160, 8, 16, False, False, False, {}),  # GGUF Q6_K: int8 groups of 16, a zero point, K tail
    (5, 30, 96, 8, 16, False, True, False, {"splits": 1}),  # a Q4_K_M q/k/v's common form: int8 g16, mins
    (37, 33, 160, 8, 16, True, False, False, {"gemv": False, "block_k": 64}),  # GEMM, four groups per K tile
    (70, 24, 256, 4, 128, True, False, False, {"gemv": False, "block_m": 64}),  # GEMM, 64-row tiles: int4 in column order
    (3, 40, 200, 4, 200, False, False, True, {}),  # int4 per channel: the scale once at the end, K tail
]


@pytest.mark.parametrize("m,n,k,bits,group,zeros,mins,bias,fields", INT_CASES)
def test_int_linear(K, m, n, k, bits, group, zeros, mins, bias, fields):
    args = int_case(m, n, k, bits, group, zeros, mins, bias, BF16, torch.Generator().manual_seed(m * 100 + n + k))
    cfg = int_config(K, m, n, k, group, **fields)
    check_int_linear(lambda *a: K.int_linear.int_linear(*a, config=cfg), args)
    assert_counters_zero()


@pytest.mark.parametrize("m,bits", [(1, 4), (5, 4), (40, 4), (3, 8)])
def test_int_linear_fp16(K, m, bits):
    """fp16 models: int4 tiles as 1024 + u in fp16 (bf16's 128 + u otherwise), int8 as bf16 does."""
    args = int_case(m, 40, 256, bits, 128, True, False, True, torch.float16, torch.Generator().manual_seed(m + bits))
    check_int_linear(lambda *a: K.int_linear.int_linear(*a, config=int_config(K, m, 40, 256, 128)), args)


@pytest.mark.parametrize("m", [1, 3, 20])
def test_int_linear_fp32(K, m):
    """fp32 models: exact products (the dots in fp32), bf16 scales."""
    args = int_case(m, 24, 128, 4, 32, True, False, True, torch.float32, torch.Generator().manual_seed(m),
                    scale_dtype=BF16)
    check_int_linear(lambda *a: K.int_linear.int_linear(*a, config=int_config(K, m, 24, 128, 32)), args)


@pytest.mark.parametrize("m,bits,group,mins", [(1, 8, 16, False), (4, 4, 32, True), (20, 8, 16, True)])
def test_int_linear_fp32_scales(K, m, bits, group, mins):
    """GGUF K-quants' forms: fp32 scales and mins (their d * sc products), groups of 16 and 32, in
    the launch table's own tiles (256 columns: sixteen groups of 16 per tile)."""
    args = int_case(m, 24, 512, bits, group, False, mins, False, BF16, torch.Generator().manual_seed(m + group),
                    scale_dtype=torch.float32)
    check_int_linear(K.int_linear.int_linear, args)


def test_int_linear_defaults_and_empty(K):
    """The launch table's own tiles; zero rows; a group size no tile aligns with (the reference)."""
    for m in (1, 4, 17):
        args = int_case(m, 20, 128, 4, 128, False, False, False, BF16, torch.Generator().manual_seed(m))
        check_int_linear(K.int_linear.int_linear, args)
    args = int_case(0, 20, 128, 4, 128, False, False, False, BF16, torch.Generator().manual_seed(0))
    assert K.int_linear.int_linear(*args).shape == (0, 20)
    args = int_case(3, 20, 192, 4, 96, True, False, False, BF16, torch.Generator().manual_seed(1))
    check_int_linear(K.int_linear.int_linear, args)


def fp8_config(K, m, n, k, scale_block, act_group, **fields):
    cfg = K.fp8_linear.launch_config(m, n, k, *scale_block, act_group, CPU)
    small = dict(block_n=16, block_k=64) if cfg.gemv else dict(block_m=32, block_n=16, block_k=64)
    return replace(cfg, **{**small, **fields})


# (m, n, k, block_n, block_k, act_group, bias, fields)
FP8_CASES = [
    (1, 40, 256, 0, 0, -1, True, {}),  # per tensor, W8A16
    (1, 36, 200, 1, 0, -1, False, {"fp8_native": True}),  # per channel, K tail, hardware conversions
    (1, 40, 256, 128, 128, -1, False, {"block_k": 256}),  # blocks, a tile spanning two
    (1, 40, 256, 128, 128, 128, True, {}),  # DeepSeek / Qwen3 FP8: W8A8 per 128 columns
    (1, 24, 320, 1, 0, 0, False, {"splits": 3}),  # W8A8 per token
    (4, 40, 256, 128, 128, 128, True, {}),
    (7, 33, 200, 1, 0, 0, False, {}),
    (16, 24, 192, 0, 0, -1, True, {"splits": 1}),
    (20, 40, 256, 128, 128, -1, True, {}),  # GEMM W8A16
    (33, 36, 200, 1, 0, 0, False, {}),  # GEMM W8A8 per token, rounding in registers (no fp8 tensor cores)
    (20, 40, 256, 128, 128, 128, True, {}),  # GEMM W8A8 per 128 columns, rounding in registers
    (20, 40, 256, 128, 128, 128, True, {"fp8_native": True, "fp8_dot": True}),  # fp8 tensor-core GEMM
    (33, 36, 192, 0, 0, 0, False, {"fp8_native": True, "fp8_dot": True}),  # fp8 GEMM, per tensor x per token
    (20, 48, 256, 1, 0, 0, True, {"fp8_native": True, "scaled_mm": True}),  # torch._scaled_mm
    (4, 40, 256, 128, 128, 128, True, {"fp8_native": True, "fp8_dot": True}),  # GEMV on fp8 tensor cores, per 128
    (1, 24, 320, 0, 0, 0, False, {"fp8_native": True, "fp8_dot": True, "splits": 3}),  # per tensor x per token
]


@pytest.mark.parametrize("m,n,k,block_n,block_k,act_group,bias,fields", FP8_CASES)
def test_fp8_linear(K, m, n, k, block_n, block_k, act_group, bias, fields):
    args = fp8_case(m, n, k, block_n, block_k, act_group, bias, BF16, torch.Generator().manual_seed(m * 100 + n + k))
    cfg = fp8_config(K, m, n, k, (block_n, block_k), act_group, **fields)
    check_fp8_linear(lambda *a: K.fp8_linear.fp8_linear(*a, config=cfg), args)
    assert_counters_zero()


@pytest.mark.parametrize("m,act_group", [(1, -1), (1, 128), (3, 0), (20, 0), (20, 128)])
def test_fp8_linear_fp32(K, m, act_group):
    """fp32 activations: W8A8's rounding through fp8 must match the reference's exactly."""
    args = fp8_case(m, 24, 256, 128, 128, act_group, True, torch.float32, torch.Generator().manual_seed(m))
    check_fp8_linear(lambda *a: K.fp8_linear.fp8_linear(*a, config=fp8_config(K, m, 24, 256, (128, 128), act_group)), args)


@pytest.mark.parametrize("one_pass_max", [32768, 64])
def test_act_quant_matches_reference(K, monkeypatch, one_pass_max):
    """fp8 activations and scales, byte for byte (subnormals, ties and the largest values
    included), each group in registers at once and (a smaller limit) in two passes."""
    from ingot.ops import reference as ref

    monkeypatch.setattr(K.fp8_linear, "ONE_PASS_MAX", one_pass_max)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 256, generator=gen) * torch.logspace(-4, 2, 256)
    x[0, :4] = torch.tensor([448.0, -3.0e-4, 0.0, 1.5e-3])
    # a row whose scale is 1 (amax 448): ties between e4m3 neighbours, normal and subnormal
    ties = [448.0, 1.0625, 1.1875, -1.0625, 432.0, -432.0, 2**-10, 3 * 2**-10, 5 * 2**-10, 2**-6 - 2**-10, -3 * 2**-10]
    x[2, : len(ties)] = torch.tensor(ties)
    x[2, len(ties):] = x[2, len(ties):].clamp(-400, 400)
    for group in (0, 128):
        q, s = K.fp8_linear.act_quant(x, group)
        q_ref, s_ref = ref.quantize_fp8_activations(x, group)
        assert torch.equal(s, s_ref)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_fp8_linear_fp16_and_empty(K):
    """fp16 activations (W8A16 GEMV and GEMM, W8A8 GEMV), and zero rows."""
    for m, act_group in ((1, -1), (3, 128), (20, -1)):
        args = fp8_case(m, 24, 256, 128, 128, act_group, True, torch.float16, torch.Generator().manual_seed(m))
        check_fp8_linear(K.fp8_linear.fp8_linear, args)
    args = fp8_case(0, 24, 256, 128, 128, 0, False, BF16, torch.Generator().manual_seed(0))
    assert K.fp8_linear.fp8_linear(*args).shape == (0, 24)


def test_launch_tables(K):
    """Which path the tables pick off-GPU (no fp8 hardware assumed) and with an sm_90 GPU's answers."""
    il, fl = K.int_linear, K.fp8_linear
    one = il.launch_config(1, 4608, 3584, 128, CPU)
    assert one.gemv and one.use_dot and one.block_k == 128  # one row on tensor cores, K tiles in one group
    assert not il.launch_config(1, 4608, 3584, 32, CPU).use_dot  # GGUF's groups of 32: the multiply-reduce
    assert not il.launch_config(1, 4608, 3584, 128, CPU, torch.float32).use_dot
    assert il.launch_config(16, 4608, 3584, 128, CPU).use_dot
    assert il.launch_config(64, 4608, 3584, 128, CPU).gemv and not il.launch_config(65, 4608, 3584, 128, CPU).gemv
    assert not il.launch_config(32, 37888, 3584, 128, CPU).gemv  # 296 GEMM tiles fill the SMs
    assert il.launch_config(8, 4608, 3584, 128, CPU, torch.float32).block_k == 32  # FMA dots: small tiles
    big = fl.launch_config(256, 4608, 3584, 128, 128, 128, CPU)
    assert not big.gemv and not big.fp8_dot and not big.fp8_native  # the interpreter: bit decoding, bf16 math
    assert fl.launch_config(1, 4608, 3584, 0, 0, 0, CPU).use_dot and not fl.launch_config(1, 4608, 3584, 0, 0, 0, CPU).fp8_dot
    assert fl.scaled_mm_fits(4608, 3584, 1, 0, 0, BF16) and not fl.scaled_mm_fits(4608, 3584, 128, 128, 0, BF16)
    assert not fl.scaled_mm_fits(4608, 3584, 1, 0, 128, BF16) and not fl.scaled_mm_fits(4608, 3584, 0, 0, 0, torch.float16)
