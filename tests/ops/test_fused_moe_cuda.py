"""The fused_moe Triton kernel on the GPU against the reference (marked cuda; run on the H200).

Every case builds fresh random inputs; the kernel module's new tensors (output, the
intermediate ``a`` and ``y``, the sorted pair list, the block experts) start as NaN
or junk, so an element a kernel forgets to write fails. Each output is compared with
the reference in fp32 from the same bf16 inputs (relative L2 < 1e-2) and with the
reference in bf16, which rounds where the kernel does (< 2e-3: only GEMM accumulation
order differs). Covers the four architectures' widths, experts 8..128, top-k 1..8,
batch 1..256, both paths (per pair and grouped) and the table's own choice, routing
that puts every token on one expert and routing that spreads them evenly, fp32 routing
weights (Mixtral), dispatch through ``torch.ops.ingot.fused_moe``, and replay from a
captured CUDA graph with new routing in the same buffers.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.ops.gpu_fixtures import PoisonTorch
from tests.ops.moe_cases import ROUTINGS, check_fused_moe, moe_inputs

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
BF16 = torch.bfloat16
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton"),
]

# (name, experts, top_k, hidden, expert width) of the four architectures
ARCHS = [
    ("qwen3-30b-a3b", 128, 8, 2048, 768),
    ("qwen1.5-moe-a2.7b", 60, 4, 2048, 1408),
    ("mixtral-8x7b", 8, 2, 4096, 14336),
    ("olmoe-1b-7b", 64, 8, 2048, 1024),
]
BATCHES = [1, 2, 4, 8, 16, 32, 64, 256]


@pytest.fixture
def M(monkeypatch):
    from ingot.ops.triton import fused_moe

    poison = PoisonTorch()
    monkeypatch.setattr(fused_moe, "torch", poison)
    fused_moe.poison = poison
    return fused_moe


@pytest.fixture(scope="module")
def weights_of():
    """One set of expert weights per architecture (Mixtral's are 2.8 GB: build each once)."""
    cache: dict[str, list[torch.Tensor]] = {}

    def get(name, e, k, h, i):
        if name not in cache:
            cache.clear()
            gen = torch.Generator(device="cuda").manual_seed(0)
            w_gate_up = (torch.randn(e, 2 * i, h, generator=gen, device="cuda") / h**0.5).to(BF16)
            w_down = (torch.randn(e, h, i, generator=gen, device="cuda") / i**0.5).to(BF16)
            cache[name] = [w_gate_up, w_down]
        return cache[name]

    return get


def arch_inputs(weights_of, name, e, k, h, i, batch, routing="random", fp32_weights=False, seed=1):
    gen = torch.Generator().manual_seed(seed + batch)
    hidden, _, _, weights, ids = moe_inputs(batch, e, k, h, 16, BF16, gen, routing, fp32_weights, device="cuda")
    w_gate_up, w_down = weights_of(name, e, k, h, i)
    return [hidden, w_gate_up, w_down, weights, ids]


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("name,e,k,h,i", ARCHS, ids=[a[0] for a in ARCHS])
def test_table_choice(M, weights_of, name, e, k, h, i, batch):
    """The op's own launch (launch_config) at the architectures' widths and every batch size."""
    args = arch_inputs(weights_of, name, e, k, h, i, batch, fp32_weights=name.startswith("mixtral"))
    check_fused_moe(M.fused_moe, args, tol=1e-2)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("batch", [1, 16, 256])
@pytest.mark.parametrize("path", ["per_pair", "per_pair_long_k", "grouped16", "grouped64"])
@pytest.mark.parametrize("name,e,k,h,i", [ARCHS[0], ARCHS[2]], ids=[ARCHS[0][0], ARCHS[2][0]])
def test_paths_and_routings(M, weights_of, name, e, k, h, i, path, batch, routing):
    """Both paths forced at small and large batches, with every token on one expert (one expert's
    blocks hold every pair: 256 x k rows) and with the tokens spread evenly."""
    launch = {"per_pair": M.PER_PAIR, "per_pair_long_k": M.PER_PAIR_LONG_K, "grouped16": M.MoeLaunch(True, 16, (64, 64, 4, 3), (64, 64, 4, 3)),
              "grouped64": M.MoeLaunch(True, 64, (64, 64, 4, 3), (128, 64, 8, 3))}[path]
    args = arch_inputs(weights_of, name, e, k, h, i, batch, routing=routing)
    check_fused_moe(lambda *a: M.run(*a, launch=launch), args, tol=1e-2)
    if routing == "random":  # each token's gate/up sums scaled (the norm's rstd handed on by the router)
        scale = torch.rand(batch, device=args[0].device) + 0.5
        check_fused_moe(lambda *a: M.run(*a, launch=launch), args + [scale], tol=1e-2)


@pytest.mark.parametrize("top_k", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("experts", [8, 16, 32, 128])
@pytest.mark.parametrize("batch", [1, 5, 33])
def test_experts_and_top_k(M, experts, top_k, batch):
    if top_k > experts:
        pytest.skip("top-k above the expert count")
    args = moe_inputs(batch, experts, top_k, 512, 384, BF16, torch.Generator().manual_seed(experts * 9 + top_k),
                      device="cuda")
    check_fused_moe(M.fused_moe, args, tol=1e-2)
    check_fused_moe(lambda *a: M.run(*a, launch=M.MoeLaunch(True, 16, (32, 64, 4, 2), (32, 64, 4, 2))), args, tol=1e-2)


def test_fp32_model_matches_reference_closely(M):
    args = moe_inputs(24, 16, 4, 256, 128, torch.float32, torch.Generator().manual_seed(3), device="cuda")
    for launch in (M.PER_PAIR, M.MoeLaunch(True, 16, (32, 32, 4, 2), (32, 32, 4, 2))):
        # fp32 models get IEEE fp32 dot products (no TF32): only accumulation order differs
        check_fused_moe(lambda *a, launch=launch: M.run(*a, launch=launch), args, tol=1e-5)


def test_op_dispatches_to_triton(M):
    from ingot.ops.triton import register_cuda_kernels

    assert register_cuda_kernels()
    args = moe_inputs(4, 8, 2, 256, 128, BF16, torch.Generator().manual_seed(5), device="cuda")
    before = M.poison.allocs
    check_fused_moe(torch.ops.ingot.fused_moe, args, tol=1e-2)
    assert M.poison.allocs > before, "the op did not reach the Triton implementation"


@pytest.mark.parametrize("batch", [1, 32])
def test_cuda_graph_replay_with_new_routing(M, batch):
    """Captured once (no host sync inside), replayed with other tokens, routing and weights in the
    same buffers: the per-pair path at batch 1, align + grouped at 32."""
    e, k, h, i = 128, 8, 2048, 768
    gen = torch.Generator().manual_seed(17)
    static = moe_inputs(batch, e, k, h, i, BF16, gen, device="cuda")

    def refill(routing):
        fresh = moe_inputs(batch, e, k, h, i, BF16, gen, routing=routing, device="cuda")
        for dst, src in zip((static[0], static[3], static[4]), (fresh[0], fresh[3], fresh[4])):
            dst.copy_(src)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            M.fused_moe(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = M.fused_moe(*static)
    for routing in ("random", "one_expert", "even", "random"):
        refill(routing)
        graph.replay()
        torch.cuda.synchronize()
        check_fused_moe(lambda *a: out.clone(), static, tol=1e-2)


def test_reference_captures_in_a_cuda_graph():
    """With the Triton kernels off (INGOT_TRITON_KERNELS=0) decode graphs capture the reference op:
    it must not sync inside the capture, and replays must follow new routing."""
    from ingot.ops import reference as ref

    gen = torch.Generator().manual_seed(23)
    static = moe_inputs(4, 16, 2, 256, 128, BF16, gen, device="cuda")
    ref.fused_moe(*static)  # cuBLAS set up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ref.fused_moe(*static)
    for routing in ("random", "one_expert"):
        fresh = moe_inputs(4, 16, 2, 256, 128, BF16, gen, routing=routing, device="cuda")
        for i in (0, 3, 4):
            static[i].copy_(fresh[i])
        graph.replay()
        torch.cuda.synchronize()
        check_fused_moe(lambda *a: out.clone(), static, tol=1e-2)
