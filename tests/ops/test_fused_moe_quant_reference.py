"""The quantized fused-MoE references (``fused_moe_int`` / ``fused_moe_fp8``) on CPU.

With weight-only quantization each is ``fused_moe`` on the experts dequantized: equal bit for
bit (fp32 and bf16, with and without a row scale), dequantizing only the experts the routing
touches. fp8 W8A8 rounds each projection's input through fp8 first: against a plain loop over
(token, expert) pairs doing that by hand.
"""

from __future__ import annotations

import pytest
import torch

import ingot.ops  # noqa: F401  (registers torch.ops.ingot.*)
from ingot.ops import reference as ref
from tests.ops.moe_quant_cases import fp8_moe_case, int_moe_case

# (bits, group, zeros, mins): GGUF Q4_0, Q4_1, Q8_0; AWQ-like g16 with zero points; int8 per row
INT_FORMATS = [(4, 32, False, False), (4, 32, False, True), (8, 32, False, False), (4, 16, True, False), (8, 0, False, False)]
# (block_n, block_k): per tensor (one block per projection), per row, blocks (of 16: the tiny shapes)
FP8_FORMATS = [(0, 0), (1, 0), (16, 16)]


def dense_int(args: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The int experts of ``args`` dequantized, stacked [E, N, K] in the activations' dtype."""
    hidden, bits, group, zero = args[0], args[11], args[12], args[13]

    def stack(q, s, z, m):
        k = q.shape[-1] * 32 // bits
        return torch.stack([ref.dequantize_int(q[e], s[e], None if z is None else z[e], None if m is None else m[e],
                                               bits, group or k, zero, hidden.dtype) for e in range(q.shape[0])])

    return stack(*args[1:5]), stack(*args[5:9])


def dense_fp8(args: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 experts of ``args`` dequantized (gate and up each with its scale blocks)."""
    hidden, block_n, block_k = args[0], args[7], args[8]

    def stack(w, s, parts):
        return torch.stack([torch.cat([ref.dequantize_fp8(wp, sp, block_n, block_k, hidden.dtype)
                                       for wp, sp in zip(w[e].chunk(parts), s[e].chunk(parts))]) for e in range(w.shape[0])])

    return stack(args[1], args[2], 2), stack(args[3], args[4], 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,group,zeros,mins", INT_FORMATS)
def test_int_equals_fused_moe_on_dequantized_experts(bits, group, zeros, mins, dtype):
    args = int_moe_case(9, 6, 2, 64, 32, bits, group, zeros, mins, dtype, torch.Generator().manual_seed(bits + group))
    w13, w2 = dense_int(args)
    hidden, weights, ids = args[0], args[9], args[10]
    assert torch.equal(torch.ops.ingot.fused_moe_int(*args), ref.fused_moe(hidden, w13, w2, weights, ids))
    scale = torch.rand(9, generator=torch.Generator().manual_seed(1)) + 0.5
    assert torch.equal(ref.fused_moe_int(*args, scale), ref.fused_moe(hidden, w13, w2, weights, ids, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_n,block_k", FP8_FORMATS)
def test_fp8_w8a16_equals_fused_moe_on_dequantized_experts(block_n, block_k, dtype):
    args = fp8_moe_case(9, 6, 2, 64, 32, block_n, block_k, -1, dtype, torch.Generator().manual_seed(block_n + 7))
    w13, w2 = dense_fp8(args)
    hidden, weights, ids = args[0], args[5], args[6]
    assert torch.equal(torch.ops.ingot.fused_moe_fp8(*args), ref.fused_moe(hidden, w13, w2, weights, ids))
    scale = torch.rand(9, generator=torch.Generator().manual_seed(2)) + 0.5
    assert torch.equal(ref.fused_moe_fp8(*args, scale), ref.fused_moe(hidden, w13, w2, weights, ids, scale))


def fp8_rounded(x: torch.Tensor, group: int) -> torch.Tensor:
    """One row rounded through fp8 with its scale(s): the largest magnitude of each group maps to 448."""
    g = group or x.numel()
    blocks = x.double().reshape(-1, g)
    scale = (blocks.abs().amax(-1, keepdim=True).float() * (1.0 / 448.0)).clamp(min=1e-12).double()
    q = (blocks / scale).clamp(-448, 448).float().to(torch.float8_e4m3fn).double()
    return (q * scale).reshape(-1)


@pytest.mark.parametrize("act_group", [0, 16])
def test_fp8_w8a8_rounds_each_input_through_fp8(act_group):
    args = fp8_moe_case(7, 6, 3, 64, 32, 16, 16, act_group, torch.float32, torch.Generator().manual_seed(act_group))
    w13, w2 = (w.double() for w in dense_fp8(args))
    hidden, weights, ids = args[0], args[5], args[6]
    scale = torch.rand(7, generator=torch.Generator().manual_seed(3)) + 0.5
    want = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ fp8_rounded(hidden[t], act_group) * float(scale[t])).chunk(2)
            want[t] += float(weights[t, j]) * (w2[e] @ fp8_rounded(torch.nn.functional.silu(gate) * up, act_group))
    got = torch.ops.ingot.fused_moe_fp8(*args, row_scale=scale)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-5


def test_only_the_routed_experts_are_dequantized(monkeypatch):
    args = int_moe_case(3, 16, 2, 64, 32, 4, 32, False, False, torch.float32, torch.Generator().manual_seed(0))
    calls = []
    real = ref.dequantize_int
    monkeypatch.setattr(ref, "dequantize_int", lambda *a: calls.append(a[0].shape) or real(*a))
    out = ref.fused_moe_int(*args)
    assert len(calls) == 2 * torch.unique(args[10]).numel() < 2 * 16  # gate_up and down of each routed expert
    assert out.shape == args[0].shape
    empty = int_moe_case(0, 16, 2, 64, 32, 4, 32, False, False, torch.float32, torch.Generator().manual_seed(0))
    assert torch.ops.ingot.fused_moe_int(*empty).shape == (0, 64)


def test_fakes_give_the_output_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    int_args = int_moe_case(5, 6, 2, 64, 32, 4, 32, False, True, torch.bfloat16, torch.Generator().manual_seed(0))
    fp8_args = fp8_moe_case(5, 6, 2, 64, 32, 16, 16, 0, torch.bfloat16, torch.Generator().manual_seed(0))
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert torch.ops.ingot.fused_moe_int(*int_args).shape == (5, 64)
        out = torch.ops.ingot.fused_moe_fp8(*fp8_args)
        assert out.shape == (5, 64) and out.dtype == torch.bfloat16
