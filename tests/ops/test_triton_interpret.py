"""The interpreter harness itself (poisoned outputs), the launch tables each kernel uses when
no configuration is passed, and the kernels' signatures against their ops.

Opt-in like every interpreter file (tests/ops/interpret_fixtures.py): ``INGOT_TEST_TRITON_INTERPRET=1
pytest tests/ops/test_triton_interpret.py`` with ``triton`` installed.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.interpret_fixtures import ENABLED, MOE, K  # noqa: F401  (the fixtures)

pytestmark = pytest.mark.skipif(not ENABLED, reason="set INGOT_TEST_TRITON_INTERPRET=1 (needs triton)")


def test_launch_configs_are_the_measured_defaults(K):
    """The tables each kernel launches with when no configuration is passed (docs/benchmarks.md)."""
    cpu = torch.device("cpu")  # 132 SMs assumed off-GPU, as on the H200
    da, sg, rn, pa = K.decode_attention, K.skinny_gemm, K.rms_norm, K.prefill_attention
    assert da.launch_config(128, 64 * 2, cpu) == da.DecodeConfig(128, 4, 3, waves=1)  # batch 64
    assert da.launch_config(128, 2, cpu) == da.DecodeConfig(64, 8, 2, waves=2)  # batch 1
    assert da.launch_config(256, 2, cpu) == da.DecodeConfig(64, 4, 3, waves=2)
    assert sg.launch_config(1, 2048, 1536, cpu) == sg.SkinnyConfig(False, 16, 256, 4, 4, waves=4)
    assert sg.launch_config(1, 2048, 1536, cpu, sg.NORM).block_n == 32
    assert sg.launch_config(1, 1536, 8960, cpu, sg.SILU).block_n == 32
    assert sg.launch_config(8, 2048, 1536, cpu) == sg.SkinnyConfig(True, 64, 64, 4, 4, waves=2)
    assert rn.launch_config(4096, 3584) == rn.RmsNormConfig(block_r=1, num_warps=8, weight_first=False)
    assert rn.launch_config(1, 1536) == rn.RmsNormConfig(block_r=1, num_warps=4, weight_first=True)
    assert rn.launch_config(300, 128) == rn.RmsNormConfig(block_r=32, num_warps=8, weight_first=False)
    assert K.rotary.launch_config() == K.rotary.RotaryConfig(tile_pairs=2048, num_warps=4)
    assert pa.launch_config(128, cpu) == pa.PrefillConfig(128, 64, 8, 3)  # sm90 takes 128-wide key tiles
    assert pa.launch_config(64, cpu) == pa.PrefillConfig(128, 64, 4, 3)
    assert pa.launch_config(256, cpu) == pa.PrefillConfig(64, 32, 4, 2)
    assert pa.context_launch_config(128, cpu) == pa.PrefillConfig(128, 64, 8, 3)


def test_kernels_take_their_ops_arguments(K, MOE):
    """Each kernel marked ``@cuda_kernel`` implements an op and accepts its arguments in the op's
    order (extra ones are optional); every op has one."""
    import inspect

    from ingot.ops import library
    from ingot.ops.triton._common import CUDA_KERNELS

    assert set(CUDA_KERNELS) == set(library.OPS)
    for name, fn in CUDA_KERNELS.items():
        op_params = [a.name for a in getattr(torch.ops.ingot, name).default._schema.arguments]
        params = list(inspect.signature(fn).parameters.values())
        assert [p.name for p in params[: len(op_params)]] == op_params, name
        assert all(p.default is not inspect.Parameter.empty for p in params[len(op_params):]), name


def test_outputs_are_poisoned(K):
    """The harness itself: new tensors in the kernel modules start as NaN."""
    assert torch.isnan(K.rms_norm.torch.empty(3)).all()
    assert torch.isnan(K.decode_attention.torch.empty_like(torch.zeros(2))).all()
