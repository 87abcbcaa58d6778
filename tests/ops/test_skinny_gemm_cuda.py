"""The Triton skinny GEMM on the GPU (marked cuda) against ingot.ops.reference: plain, with its
fused prologues and router epilogue, the sweep's configurations, and CUDA-graph replay."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ingot.ops import reference as ref
from tests.ops.gpu_fixtures import BF16, TOL, K, gpu  # noqa: F401  (K: the fixture)
from tests.ops.kernel_cases import check_linear_norm_router, check_prologue_linear, rel_err


@gpu
@pytest.mark.parametrize("m", [1, 2, 7, 16])
@pytest.mark.parametrize("n,k,bias", [(2048, 1536, True), (1536, 8960, False), (17920, 1536, False), (4608, 3584, True), (131, 200, True)])
def test_skinny_linear(K, m, n, k, bias):
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(BF16).cuda()
    w = (0.05 * torch.randn(n, k, generator=gen)).to(BF16).cuda()
    b = torch.randn(n, generator=gen).to(BF16).cuda() if bias else None
    out = K.skinny_gemm.skinny_linear(x, w, b)
    expected = ref.skinny_linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == BF16 and out.shape == (m, n)
    assert rel_err(out, expected) < TOL


@gpu
@pytest.mark.parametrize("m", [1, 5, 40])
def test_logits_in_fp32(m):
    """The logits projection (``layers.linear.logits_linear``) on both of its GPU paths, the
    skinny GEMV (one row) and cuBLAS with an fp32 output (more): fp32 sums, unrounded, and
    a row's logits the same within summation order whichever path and batch it takes."""
    from ingot.layers.linear import logits_linear
    from ingot.layers.policy import OpPolicy
    from ingot.ops.triton import register_cuda_kernels

    assert register_cuda_kernels()  # the skinny path through torch.ops.ingot, as the engine runs it

    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 576, generator=gen).to(BF16).cuda()
    w = (0.05 * torch.randn(49152, 576, generator=gen)).to(BF16).cuda()
    policy = OpPolicy(skinny_rows=1)
    out = logits_linear(x, w, policy)
    assert out.dtype == torch.float32 and out.shape == (m, 49152)
    assert rel_err(out, x.double() @ w.double().T) < 1e-5
    first = logits_linear(x[:1], w, policy)
    assert (out[:1] - first).abs().max().item() < 1e-4


@gpu
@pytest.mark.parametrize("prologue", ["norm", "norm_scaled", "silu", "gelu"])
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n,k,bias", [
    (2048, 1536, True), (17920, 1536, False), (1536, 8960, False), (3584, 18944, False), (131, 200, True),
    (128, 2048, False), (8, 4096, False),  # MoE routers: Qwen3-30B-A3B, Mixtral-8x7B
])
@pytest.mark.parametrize("fields", [{}, {"block_n": 64}, {"block_n": 8, "num_warps": 1, "waves": 16}, {"splits": 1}])
def test_prologue_linear(K, prologue, m, n, k, bias, fields):
    """The norm (also handing on its input in two factors) and SiLU prologues of the skinny GEMM
    against the reference ops (kernel_cases), with the default tiles, wide tiles, narrow one-warp
    programs and whole-K programs."""
    code = {"silu": K.skinny_gemm.SILU, "gelu": K.skinny_gemm.GELU_TANH}.get(prologue, K.skinny_gemm.NORM)
    cfg = replace(K.skinny_gemm.launch_config(m, n, k, torch.device("cuda"), code), **fields)
    check_prologue_linear(K.skinny_gemm, prologue, m, n, k, bias, torch.Generator().manual_seed(m + n + k), "cuda", cfg)


@gpu
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("n,k,experts,bias", [
    (2048, 4096, 128, False), (4096, 4096, 8, False), (2048, 2048, 64, False),  # Qwen3-30B-A3B, Mixtral, OLMoE o_proj
    (131, 200, 5, True),
])
@pytest.mark.parametrize("fields", [{}, {"block_n": 32}, {"block_n": 8, "num_warps": 1, "waves": 16}, {"splits": 1}])
def test_linear_norm_router(K, m, n, k, experts, bias, fields):
    """o_proj with a MoE layer's norm and router in its epilogue against the plain GEMV and the
    reference ops (kernel_cases), with the default tiles, wide tiles, narrow one-warp programs
    and whole-K programs; four rows run the two-launch form."""
    cfg = replace(K.skinny_gemm.launch_config(m, n, k, torch.device("cuda"), router=True), **fields)
    check_linear_norm_router(K.skinny_gemm, m, n, k, experts, bias, torch.Generator().manual_seed(n + k), "cuda", cfg)


@gpu
@pytest.mark.parametrize("use_dot,block_n,block_k,warps,waves", [(False, 64, 128, 8, 2), (True, 16, 256, 4, 1),
                                                                 (False, 128, 64, 4, 4)])
def test_skinny_linear_sweep_configs(K, use_dot, block_n, block_k, warps, waves):
    """Configurations the skinny sweep (benchmarks/kernels.py --sweep skinny) runs at one row."""
    gen = torch.Generator().manual_seed(block_n + block_k)
    x = torch.randn(1, 1536, generator=gen).to(BF16).cuda()
    w = (0.05 * torch.randn(2048, 1536, generator=gen)).to(BF16).cuda()
    cfg = K.skinny_gemm.SkinnyConfig(use_dot, block_n, block_k, warps, 4, waves)
    out = K.skinny_gemm.skinny_linear(x, w, None, config=cfg)
    assert rel_err(out, ref.skinny_linear(x.float(), w.float(), None)) < TOL


@gpu
def test_skinny_linear_cuda_graph_replay(K):
    """Split-K counters survive replays: captured once, replayed with new inputs."""
    gen = torch.Generator().manual_seed(3)
    x = torch.empty(4, 1536, dtype=BF16, device="cuda")
    w = (0.05 * torch.randn(1536, 1536, generator=gen)).to(BF16).cuda()
    x.copy_(torch.randn(4, 1536, generator=gen).to(BF16))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        K.skinny_gemm.skinny_linear(x, w, None)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.skinny_gemm.skinny_linear(x, w, None)
    for _ in range(3):
        x.copy_(torch.randn(4, 1536, generator=gen).to(BF16))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref.skinny_linear(x.float(), w.float(), None)) < TOL
