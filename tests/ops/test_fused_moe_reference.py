"""The PyTorch reference of ``torch.ops.ingot.fused_moe``: against a plain per-token loop, against
transformers' own eager experts (bit for bit in fp32), and the op's dispatch and fake."""

from __future__ import annotations

import pytest
import torch

import ingot.ops  # noqa: F401  (registers torch.ops.ingot.*)
from ingot.ops import reference as ref


def moe_case(t: int, e: int, k: int, h: int, i: int, dtype=torch.float32, seed: int = 0, ids=None):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=gen).to(dtype)
    w_gate_up = (0.2 * torch.randn(e, 2 * i, h, generator=gen)).to(dtype)
    w_down = (0.2 * torch.randn(e, h, i, generator=gen)).to(dtype)
    if ids is None:
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    weights = torch.rand(t, k, generator=gen).softmax(-1).to(dtype)
    return hidden, w_gate_up, w_down, weights, ids.long()


def plain_loop(hidden, w_gate_up, w_down, weights, ids) -> torch.Tensor:
    """Token by token, expert by expert, in fp64."""
    i = w_down.shape[-1]
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        x = hidden[t].double()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate = w_gate_up[e, :i].double() @ x
            up = w_gate_up[e, i:].double() @ x
            out[t] += float(weights[t, j]) * (w_down[e].double() @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("t,e,k,h,i", [(1, 8, 2, 16, 8), (7, 6, 3, 32, 12), (20, 4, 4, 8, 24), (5, 16, 1, 16, 16)])
def test_reference_matches_plain_loop(t, e, k, h, i):
    args = moe_case(t, e, k, h, i, seed=t + e)
    got = ref.fused_moe(*args)
    assert got.dtype == torch.float32 and got.shape == (t, h)
    torch.testing.assert_close(got.double(), plain_loop(*args), rtol=1e-5, atol=1e-5)


def test_reference_bf16_close_to_plain_loop_and_fp32_weights_kept():
    """bf16 activations: within bf16 rounding of the exact result; fp32 routing weights (Mixtral)
    multiply in fp32, so they may differ from bf16 ones only by the weights' own rounding."""
    args = moe_case(9, 8, 2, 64, 32, dtype=torch.bfloat16, seed=5)
    exact = plain_loop(*args)
    got = ref.fused_moe(*args)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - exact).norm() / exact.norm()) < 1e-2
    hidden, wgu, wd, weights, ids = args
    fp32 = ref.fused_moe(hidden, wgu, wd, weights.float(), ids)
    assert fp32.dtype == torch.bfloat16 and ((fp32.double() - exact).norm() / exact.norm()) < 1e-2


def test_every_token_on_one_expert_and_empty_batch():
    args = moe_case(6, 5, 1, 16, 8, ids=torch.full((6, 1), 3))
    torch.testing.assert_close(ref.fused_moe(*args).double(), plain_loop(*args), rtol=1e-5, atol=1e-5)
    empty = moe_case(0, 5, 2, 16, 8)
    assert ref.fused_moe(*empty).shape == (0, 16)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_reference_is_transformers_eager_experts_bit_for_bit(family):
    """fp32: the same ops in the same order as transformers' eager experts loop, so equal exactly."""
    transformers = pytest.importorskip("transformers")
    t, e, k, h, i = 11, 8, 3, 32, 16
    hidden, w_gate_up, w_down, weights, ids = moe_case(t, e, k, h, i, seed=9)
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as Experts

        config = transformers.Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e)
    else:
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as Experts

        config = transformers.MixtralConfig(hidden_size=h, intermediate_size=i, num_local_experts=e)
    config._experts_implementation = "eager"
    experts = Experts(config)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w_gate_up)
        experts.down_proj.copy_(w_down)
        expected = experts(hidden, ids, weights)
    assert torch.equal(ref.fused_moe(hidden, w_gate_up, w_down, weights, ids), expected)


def test_op_dispatches_to_the_reference_and_has_a_fake():
    args = moe_case(4, 6, 2, 16, 8, seed=3)
    assert torch.equal(torch.ops.ingot.fused_moe(*args), ref.fused_moe(*args))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) for a in args]
        out = torch.ops.ingot.fused_moe(*fake)
    assert out.shape == (4, 16) and out.dtype == torch.float32


def test_graph_safe_form_sums_the_same():
    """The form a CUDA-graph capture runs (every expert on every token, unrouted ones weighted 0)."""
    args = moe_case(13, 8, 3, 32, 16, seed=21)
    routed = ref._experts_loop(*args, every_expert=False)
    torch.testing.assert_close(ref._experts_loop(*args, every_expert=True), routed, rtol=1e-6, atol=1e-6)
    assert torch.equal(routed, ref.fused_moe(*args))
    scale = torch.rand(13, generator=torch.Generator().manual_seed(3)) + 0.5
    torch.testing.assert_close(ref._experts_loop(*args, every_expert=True, row_scale=scale),
                               ref._experts_loop(*args, every_expert=False, row_scale=scale), rtol=1e-6, atol=1e-6)


def test_row_scale_multiplies_each_tokens_gate_up_sums():
    """``row_scale`` [T] scales token t's gate and up sums: the plain fp64 loop on the scaled rows,
    whichever way the tokens' experts overlap."""
    hidden, w_gate_up, w_down, weights, ids = moe_case(6, 8, 3, 16, 12, seed=4)
    scale = torch.rand(6, generator=torch.Generator().manual_seed(5)) + 0.5
    got = ref.fused_moe(hidden, w_gate_up, w_down, weights, ids, scale)
    want = plain_loop(hidden * scale[:, None], w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, ref.fused_moe(hidden, w_gate_up, w_down, weights, ids), rtol=1e-3)
