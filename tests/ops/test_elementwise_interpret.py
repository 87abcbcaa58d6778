"""store_kv, RMSNorm, fused add + RMSNorm, SiLU-and-mul and rotary in the Triton interpreter
against the reference ops. Gated by tests/ops/interpret_fixtures.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ingot.ops import reference as ref
from tests.ops.interpret_fixtures import ENABLED, K  # noqa: F401  (K: the fixture)
from tests.ops.kernel_cases import check_store_kv, rel_err, rope_table

pytestmark = pytest.mark.skipif(not ENABLED, reason="set INGOT_TEST_TRITON_INTERPRET=1 (needs triton)")


def test_store_kv(K):
    check_store_kv(K.kv_store.store_kv, t=9, hkv=2, d=64, page=16, nb=6, gen=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(5, 96), (3, 4, 32), (1, 200)])
def test_rms_norm(K, dtype, shape):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    out = K.rms_norm.rms_norm(x, w, 1e-6)
    expected = ref.rms_norm(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, expected) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_rms_norm_strided_heads(K):
    """The per-head q/k norm of Qwen3: [T, H, D] views into a fused qkv output."""
    gen = torch.Generator().manual_seed(4)
    t, h, d = 5, 3, 32
    qkv = torch.randn(t, (h + 2) * d, generator=gen).to(torch.bfloat16)
    q = qkv[:, : h * d].reshape(t, h, d)
    w = torch.randn(d, generator=gen).to(torch.bfloat16)
    out = K.rms_norm.rms_norm(q, w, 1e-6)
    expected = ref.rms_norm(q, w, 1e-6)
    assert rel_err(out, expected) < 1e-2


@pytest.mark.parametrize("fields", [{}, {"block_r": 1, "num_warps": 2, "weight_first": True},
                                    {"block_r": 4, "num_warps": 4, "weight_first": False}])
def test_add_rms_norm(K, fields):
    """The default configuration (all 6 rows in one program), one row per program, and
    a last program with rows past the end."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 160, generator=gen).to(torch.bfloat16)
    r = torch.randn(6, 160, generator=gen).to(torch.bfloat16)
    w = torch.randn(160, generator=gen).to(torch.bfloat16)
    cfg = replace(K.rms_norm.launch_config(6, 160), **fields)
    out, res = K.rms_norm.add_rms_norm(x, r, w, 1e-5, cfg)
    exp_out, exp_res = ref.add_rms_norm(x, r, w, 1e-5)
    # the interpreter truncates fp32 -> bf16 (GPUs round to nearest), so no
    # bit-exactness here: tests/ops/test_elementwise_kernels_cuda.py checks that on the GPU
    assert rel_err(res, exp_res) < 1e-2
    assert rel_err(out, exp_out) < 1e-2


@pytest.mark.parametrize("shape", [(7, 2 * 200), (2, 3, 2 * 64), (1, 2 * 1500)])
def test_silu_and_mul(K, shape):
    gen = torch.Generator().manual_seed(6)
    x = (2 * torch.randn(*shape, generator=gen)).to(torch.bfloat16)
    out = K.activation.silu_and_mul(x)
    expected = ref.silu_and_mul(x)
    assert out.shape == expected.shape
    assert rel_err(out, expected) < 1e-2


@pytest.mark.parametrize("t,hq,hkv,d", [
    (6, 4, 2, 64), (6, 7, 1, 128), (6, 2, 2, 32),
    (1, 12, 2, 64),  # decode
    (37, 9, 3, 128),  # odd head counts, tokens not a tile multiple
    (19, 28, 4, 128),  # the benchmark's heads
    (3, 40, 8, 128),  # q's heads split over two tiles
    (5, 3, 1, 48),  # half head dim not a power of two
])
def test_rotary(K, t, hq, hkv, d):
    gen = torch.Generator().manual_seed(7 + t + hq + d)
    max_pos = 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(torch.bfloat16)
    q = qkv[:, : hq * d].reshape(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d)
    cache = rope_table(max_pos, d, 10000.0)
    positions = torch.randint(0, max_pos, (t,), generator=gen)
    q_exp, k_exp = ref.rotary_embedding(positions, q, k, cache)
    # the default tiles, and small ones (several tiles per tensor, heads split across them)
    for cfg in (None, K.rotary.RotaryConfig(tile_pairs=64, num_warps=2)):
        q_out, k_out = K.rotary.rotary_embedding(positions, q, k, cache, cfg)
        assert rel_err(q_out, q_exp) < 1e-2 and rel_err(k_out, k_exp) < 1e-2
        # bf16 rounding is done with integer ops, so even the interpreter (which truncates
        # its own fp32 -> bf16 casts) must match eager bit for bit
        assert torch.equal(q_out, q_exp) and torch.equal(k_out, k_exp)
