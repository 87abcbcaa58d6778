"""The quantized fused-MoE kernels on the GPU against the reference (marked cuda).

At the Qwen3-30B-A3B expert shape (H 2048, I 768, 128 experts, top-8), batches 1, 16, 64 and
256, in the formats checkpoints bring: int4 in groups of 128 (online int4; AWQ with zero
points), GGUF's Q4_0 / Q4_1 / Q8_0 (groups of 32, mins), int8 per row (online int8), fp8 per
tensor with W8A8 per token (online fp8), 128 x 128 blocks with W8A8 per 128 columns (Qwen3
FP8) and W8A16. The kernel module's new tensors start as NaN or junk (an element a kernel
forgets to write fails); errors are relative L2 against the reference op in fp32 on the same
inputs (tests/ops/moe_quant_cases.py). Also: both paths forced, row scales, routings that put
every token on one expert or spread them evenly, fp8 GEMMs with and without fp8 tensor cores,
dispatch through ``torch.ops.ingot``, replay from a captured CUDA graph with new routing, and
``torch.compile`` keeping the ops opaque.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from tests.ops.gpu_fixtures import PoisonTorch
from tests.ops.kernel_cases import rel_err
from tests.ops.moe_cases import ROUTINGS
from tests.ops.moe_quant_cases import assert_near_reference, check_quant_moe, fp8_experts, fp8_moe_case, int_experts, int_moe_case

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
BF16 = torch.bfloat16
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton"),
]
E, TOP_K, H, I = 128, 8, 2048, 768  # Qwen3-30B-A3B
BATCHES = [1, 16, 64, 256]
# name -> ("int", bits, group, zeros, mins) or ("fp8", block_n, block_k, act_group)
FORMATS = {
    "int4-g128": ("int", 4, 128, False, False), "int4-g128-zeros": ("int", 4, 128, True, False),
    "q4_0": ("int", 4, 32, False, False), "q4_1": ("int", 4, 32, False, True), "q8_0": ("int", 8, 32, False, False),
    "int8-row": ("int", 8, 0, False, False),
    "fp8-tensor-w8a8-token": ("fp8", 0, 0, 0), "fp8-block-w8a8-g128": ("fp8", 128, 128, 128),
    "fp8-block-w8a16": ("fp8", 128, 128, -1),
}


@pytest.fixture
def Q(monkeypatch):
    from ingot.ops.triton import fused_moe_quant

    poison = PoisonTorch()
    monkeypatch.setattr(fused_moe_quant, "torch", poison)
    fused_moe_quant.poison = poison
    return fused_moe_quant


@pytest.fixture(scope="module")
def experts_of():
    """One set of experts per format (built once: 128 experts of the real shape)."""
    cache: dict[str, tuple] = {}

    def get(fmt: str) -> tuple:
        if fmt not in cache:
            cache.clear()
            gen = torch.Generator(device="cuda").manual_seed(0)
            kind, *spec = FORMATS[fmt]
            if kind == "int":
                bits, group, zeros, mins = spec
                cache[fmt] = (int_experts(E, 2 * I, H, bits, group, zeros, mins, gen),
                              int_experts(E, H, I, bits, group, zeros, mins, gen))
            else:
                block_n, block_k, _ = spec
                cache[fmt] = (fp8_experts(E, 2 * I, H, block_n, block_k, 2, gen), fp8_experts(E, H, I, block_n, block_k, 1, gen))
        return cache[fmt]

    return get


def case(experts_of, fmt: str, batch: int, routing: str = "random", seed: int = 1) -> list:
    kind, *spec = FORMATS[fmt]
    gen = torch.Generator(device="cuda").manual_seed(seed + batch)
    if kind == "int":
        return int_moe_case(batch, E, TOP_K, H, I, *spec, BF16, gen, routing, experts=experts_of(fmt))
    return fp8_moe_case(batch, E, TOP_K, H, I, *spec, BF16, gen, routing, experts=experts_of(fmt))


def op_of(Q, args: list):
    return Q.fused_moe_fp8 if args[1].dtype == torch.float8_e4m3fn else Q.fused_moe_int


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_table_choice_qwen3_30b_a3b(Q, experts_of, fmt, batch):
    """The ops' own launches (launch_config) at the real expert shape and every batch size."""
    args = case(experts_of, fmt, batch)
    check_quant_moe(op_of(Q, args), args)
    scale = torch.rand(batch, device="cuda") + 0.5  # the norm's rstd handed on by the router's GEMV
    check_quant_moe(op_of(Q, args), args, row_scale=scale)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("batch", [1, 16, 256])
@pytest.mark.parametrize("path", ["per_pair", "grouped16", "grouped64"])
@pytest.mark.parametrize("fmt", ["int4-g128-zeros", "q4_1", "fp8-block-w8a8-g128"])
def test_paths_and_routings(Q, experts_of, fmt, path, batch, routing):
    """Both paths forced at small and large batches, every token on one expert and tokens spread evenly."""
    L = Q.QuantMoeLaunch
    launch = {"per_pair": L(False, 1, (16, 256, 4, 4), (16, 256, 4, 4)),
              "grouped16": L(True, 16, (64, 64, 4, 3), (64, 64, 4, 3)),
              "grouped64": L(True, 64, (64, 64, 4, 3), (128, 64, 8, 3))}[path]
    if fmt.startswith("fp8"):
        launch = replace(launch, fp8_native=True, fp8_dot=True)
    args = case(experts_of, fmt, batch, routing)
    check_quant_moe(lambda *a, **kw: op_of(Q, args)(*a, **kw, launch=launch), args)


@pytest.mark.parametrize("batch", [16, 256])
@pytest.mark.parametrize("fmt", ["fp8-tensor-w8a8-token", "fp8-block-w8a8-g128"])
def test_fp8_grouped_without_fp8_dots(Q, experts_of, fmt, batch):
    """W8A8 GEMMs rounding the activations in registers and dotting them in bf16 (GPUs without fp8
    tensor cores), and with fp8 decoded by bits."""
    args = case(experts_of, fmt, batch)
    for launch in (replace(Q.launch_config(E, I, batch, args[0].device, fp8=True), fp8_dot=False),
                   replace(Q.launch_config(E, I, batch, args[0].device, fp8=True), fp8_dot=False, fp8_native=False)):
        check_quant_moe(lambda *a, **kw: Q.fused_moe_fp8(*a, **kw, launch=launch), args)


def test_fp32_model(Q):
    gen = torch.Generator(device="cuda").manual_seed(3)
    args = int_moe_case(24, 16, 4, 256, 128, 4, 32, True, False, torch.float32, gen)
    for launch in (Q.launch_config(16, 128, 1, args[0].device), Q.launch_config(16, 128, 24, args[0].device)):
        check_quant_moe(lambda *a, **kw: Q.fused_moe_int(*a, **kw, launch=launch), args)


def test_ops_dispatch_to_triton(Q, experts_of):
    from ingot.ops.triton import register_cuda_kernels

    assert register_cuda_kernels()
    for fmt, op in (("q4_0", torch.ops.ingot.fused_moe_int), ("fp8-block-w8a8-g128", torch.ops.ingot.fused_moe_fp8)):
        before = Q.poison.allocs
        check_quant_moe(op, case(experts_of, fmt, 4))
        assert Q.poison.allocs > before, "the op did not reach the Triton implementation"


@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("fmt", ["int4-g128", "fp8-block-w8a8-g128"])
def test_cuda_graph_replay_with_new_routing(Q, experts_of, fmt, batch):
    """Captured once (no host sync inside), replayed with other tokens, routing and weights in the
    same buffers: each replay equals the eager call."""
    static = case(experts_of, fmt, batch)
    fn = op_of(Q, static)
    w_at = 5 if fmt.startswith("fp8") else 9
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    for seed, routing in enumerate(ROUTINGS):
        fresh = case(experts_of, fmt, batch, routing, seed=100 + seed)
        for j in (0, w_at, w_at + 1):
            static[j].copy_(fresh[j])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fn(*static))
        assert_near_reference(out, static)


@pytest.mark.parametrize("batch", [1, 64])
def test_torch_compile_keeps_the_ops_opaque(experts_of, batch):
    """Under torch.compile each op is one opaque node: one graph, no break, the eager result."""
    import torch._dynamo.testing

    from ingot.ops.triton import register_cuda_kernels

    assert register_cuda_kernels()
    int_args, fp8_args = case(experts_of, "q4_0", batch), case(experts_of, "fp8-block-w8a8-g128", batch)

    def f(x):
        h = torch.ops.ingot.fused_moe_int(x, *int_args[1:])
        return torch.ops.ingot.fused_moe_fp8(torch.nn.functional.silu(h), *fp8_args[1:])

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    out = torch.compile(f, backend=counter, fullgraph=True, dynamic=False)(int_args[0])
    assert counter.frame_count == 1
    targets = [str(node.target) for gm in counter.graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert any("fused_moe_int" in t for t in targets) and any("fused_moe_fp8" in t for t in targets), targets
    assert rel_err(out, f(int_args[0])) < 1e-2
