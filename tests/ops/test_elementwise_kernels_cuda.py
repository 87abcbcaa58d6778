"""Triton store_kv, RMSNorm, fused add + RMSNorm, SiLU-and-mul and rotary on the GPU (marked
cuda) against ingot.ops.reference: within TOL, and bit-equal but for the fp32 sum order."""

from __future__ import annotations

import pytest
import torch

from ingot.ops import reference as ref
from ingot.ops.triton._common import next_pow2
from tests.ops.gpu_fixtures import BF16, TOL, K, gpu  # noqa: F401  (K: the fixture)
from tests.ops.kernel_cases import check_store_kv, rel_err, rope_table


def mismatch(out: torch.Tensor, expected: torch.Tensor) -> float:
    """Fraction of elements that differ bit-wise."""
    return (out != expected).float().mean().item()


@gpu
@pytest.mark.parametrize("t,hkv,d", [(1, 8, 128), (37, 4, 128), (300, 2, 64), (64, 8, 256)])
def test_store_kv(K, t, hkv, d):
    gen = torch.Generator().manual_seed(t + hkv + d)
    check_store_kv(K.kv_store.store_kv, t, hkv, d, page=16, nb=t // 16 + 8, gen=gen, device="cuda", dtype=BF16)


@gpu
@pytest.mark.parametrize("t,h", [(1, 896), (7, 3584), (256, 4096), (4096, 3584), (3, 8192)])
def test_rms_norm(K, t, h):
    gen = torch.Generator().manual_seed(t + h)
    x = torch.randn(t, h, generator=gen).to(BF16).cuda()
    w = (1 + 0.1 * torch.randn(h, generator=gen)).to(BF16).cuda()
    out = K.rms_norm.rms_norm(x, w, 1e-6)
    expected = ref.rms_norm(x, w, 1e-6)
    assert rel_err(out, expected) < TOL
    assert mismatch(out, expected) < 0.02  # same casts: differences only from the fp32 sum order
    exp32 = ref.rms_norm(x.float(), w.float(), 1e-6)
    assert rel_err(out, exp32) < TOL


@gpu
def test_rms_norm_strided_heads(K):
    """The per-head q/k norm (Qwen3): [T, H, D] views into a fused qkv output."""
    gen = torch.Generator().manual_seed(3)
    t, h, d = 33, 16, 128
    qkv = torch.randn(t, (h + 4) * d, generator=gen).to(BF16).cuda()
    q = qkv[:, : h * d].reshape(t, h, d)
    w = torch.randn(d, generator=gen).to(BF16).cuda()
    out = K.rms_norm.rms_norm(q, w, 1e-6)
    expected = ref.rms_norm(q, w, 1e-6)
    assert rel_err(out, expected) < TOL
    assert mismatch(out, expected) < 0.02


@gpu
@pytest.mark.parametrize("t,h", [(1, 896), (5, 3584), (4096, 3584)])
def test_add_rms_norm(K, t, h):
    gen = torch.Generator().manual_seed(t * h)
    x = torch.randn(t, h, generator=gen).to(BF16).cuda()
    r = torch.randn(t, h, generator=gen).to(BF16).cuda()
    w = torch.randn(h, generator=gen).to(BF16).cuda()
    out, res = K.rms_norm.add_rms_norm(x, r, w, 1e-5)
    exp_out, exp_res = ref.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(res, exp_res)  # the add rounded once, like torch
    assert rel_err(out, exp_out) < TOL
    assert mismatch(out, exp_out) < 0.02


@gpu
@pytest.mark.parametrize("elems,warps,weight_first", [(8192, 16, True), (2048, 4, False)])
@pytest.mark.parametrize("t,h", [(7, 3584), (4096, 3584), (33, 128)])
def test_rms_norm_configs(K, elems, warps, weight_first, t, h):
    """Every configuration the elementwise sweep may pick stays exact: rows of
    ``add_rms_norm`` whole or several per program, the weight loaded first or last."""
    gen = torch.Generator().manual_seed(t + h + warps)
    x = torch.randn(t, h, generator=gen).to(BF16).cuda()
    r = torch.randn(t, h, generator=gen).to(BF16).cuda()
    w = (1 + 0.1 * torch.randn(h, generator=gen)).to(BF16).cuda()
    block_r = max(1, min(elems // next_pow2(h), next_pow2(t)))
    cfg = K.rms_norm.RmsNormConfig(block_r=block_r, num_warps=warps, weight_first=weight_first)
    out, res = K.rms_norm.add_rms_norm(x, r, w, 1e-5, cfg)
    plain = K.rms_norm.rms_norm(x, w, 1e-5, cfg)
    exp_out, exp_res = ref.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(res, exp_res)
    assert rel_err(out, exp_out) < TOL and mismatch(out, exp_out) < 0.02
    expected = ref.rms_norm(x, w, 1e-5)
    assert rel_err(plain, expected) < TOL and mismatch(plain, expected) < 0.02


@gpu
@pytest.mark.parametrize("shape", [(1, 2 * 4864), (7, 2 * 18944), (4096, 2 * 3584), (2, 3, 2 * 100)])
def test_silu_and_mul(K, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (2 * torch.randn(*shape, generator=gen)).to(BF16).cuda()
    out = K.activation.silu_and_mul(x)
    expected = ref.silu_and_mul(x)
    assert rel_err(out, expected) < TOL
    assert mismatch(out, expected) < 0.02
    assert rel_err(out, ref.silu_and_mul(x.float())) < TOL


@gpu
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 14, 2, 64), (37, 28, 4, 128), (4096, 28, 4, 128), (5, 32, 8, 256)])
def test_rotary(K, t, hq, hkv, d):
    gen = torch.Generator().manual_seed(t + hq + d)
    max_pos = 8192
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(BF16).cuda()
    q = qkv[:, : hq * d].reshape(t, hq, d)  # strided, as the model passes them
    k = qkv[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d)
    cache = rope_table(max_pos, d).cuda()
    positions = torch.randint(0, max_pos, (t,), generator=gen).cuda()
    q_exp, k_exp = ref.rotary_embedding(positions, q, k, cache)
    # the default tiles and the corners of the elementwise sweep
    for cfg in (None, K.rotary.RotaryConfig(1024, 2), K.rotary.RotaryConfig(8192, 8)):
        q_out, k_out = K.rotary.rotary_embedding(positions, q, k, cache, cfg)
        assert rel_err(q_out, q_exp) < TOL and rel_err(k_out, k_exp) < TOL
        assert mismatch(q_out, q_exp) < 1e-3 and mismatch(k_out, k_exp) < 1e-3  # same casts, same order
