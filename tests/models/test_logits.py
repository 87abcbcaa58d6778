"""The logits projection keeps fp32 sums (``layers.linear.logits_linear``): bf16 logits tie or
swap at gaps of one bf16 step, so greedy picks of two forwards that round their logits
differently would differ (speculative verify rows against decode rows, the decode modes)."""

from __future__ import annotations

import torch

from ingot.layers.embedding import Embedding, LMHead
from ingot.ops import reference as ref


def test_bf16_model_logits_are_fp32_sums_on_the_skinny_path():
    """One row through ``torch.ops.ingot.skinny_linear`` with an fp32 output (its PyTorch
    reference on the CPU, the Triton GEMV on a GPU: tests/ops/test_skinny_gemm_cuda.py)."""
    from ingot.layers.policy import OpPolicy

    gen = torch.Generator().manual_seed(0)
    head = LMHead(300, 64, None)
    head.weight.data = torch.randn(300, 64, generator=gen).to(torch.bfloat16)
    hidden = torch.randn(1, 64, generator=gen).to(torch.bfloat16)
    logits = head(hidden, OpPolicy(skinny_rows=1))
    assert logits.dtype == torch.float32 and logits.shape == (1, 300)
    exact = hidden.double() @ head.weight.double().T
    assert (logits.double() - exact).abs().max().item() < 1e-4  # bf16 logits of ~8 would be off by up to 0.03
    assert (logits.bfloat16().double() - exact).abs().max().item() > 1e-3  # (which rounding would lose)
    assert head(hidden.expand(3, 64)).dtype == torch.float32  # more rows on the CPU: rounded, then upcast


def test_tied_fp32_model_unchanged():
    emb = Embedding(50, 16)
    emb.weight.data = torch.randn(50, 16)
    head = LMHead(50, 16, emb)
    hidden = torch.randn(3, 16)
    assert torch.equal(head(hidden), torch.nn.functional.linear(hidden, emb.weight))


def test_reference_skinny_linear_out_dtype():
    x = torch.randn(2, 32).to(torch.bfloat16)
    w = torch.randn(7, 32).to(torch.bfloat16)
    out = ref.skinny_linear(x, w, None, torch.float32)
    assert out.dtype == torch.float32
    assert torch.allclose(out, x.float() @ w.float().T)
    assert ref.skinny_linear(x, w, None).dtype == torch.bfloat16
