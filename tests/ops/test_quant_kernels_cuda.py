"""The int_linear / fp8_linear Triton kernels on the GPU against the reference (marked cuda).

Inputs are built on the GPU (tests/ops/quant_cases.py); the kernel modules' new tensors
start as NaN or junk, so an element a kernel forgets to write fails. Errors are relative
L2 against the reference op computed in fp32 from the same inputs (weights dequantized
exactly): below 1e-2 for bf16 / fp16 outputs (their own rounding is about 2e-3; the GEMMs
also round each dequantized weight to bf16, as the reference op does), 1e-5 for fp32;
W8A8 also below 0.4 times the W8A8 reference's distance from W8A16 (2-3%), so activations
must be rounded through fp8 as the reference rounds them.

Covers the 7B projections (qkv, o, gate_up, down) at batch 1, 16, 64 and 256 in int4 g128
(zero points), int8 per channel, GGUF-like int4 g32 with mins, fp8 per tensor (W8A16),
per channel (W8A8 per token) and 128 x 128 blocks (W8A16, W8A8 per 128 columns); every
W8A8 GEMM route; configurations off the launch table; the prmt unpacking against shifts;
fp16 and fp32 models; the fp8 activations byte for byte; dispatch through
``torch.ops.ingot``; capture in a CUDA graph; and ``torch.compile`` with the ops opaque.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from tests.ops.gpu_fixtures import PoisonTorch
from tests.ops.kernel_cases import rel_err
from tests.ops.quant_cases import (
    PROJECTIONS_7B, check_fp8_linear, check_int_linear, fp8_case, fp8_expected, fp8_weight, int_case, int_expected,
    int_weight,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
BF16 = torch.bfloat16
BATCHES = [1, 16, 64, 256]
DEVICE = "cuda"
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton"),
]

# name -> (bits, group (0: the whole row), zeros, mins)
INT_FORMATS = {"int4-g128-zeros": (4, 128, True, False), "int8-channel": (8, 0, False, False),
               "int4-g32-mins": (4, 32, False, True)}
# name -> (block_n, block_k, act_group)
FP8_FORMATS = {"per-tensor-w8a16": (0, 0, -1), "channel-w8a8-token": (1, 0, 0),
               "block-w8a16": (128, 128, -1), "block-w8a8-g128": (128, 128, 128)}


@pytest.fixture
def Q(monkeypatch):
    """The kernel modules with poisoned allocations (``Q.poison`` counts them)."""
    from ingot.ops.triton import fp8_linear, int_linear, quant_gemm

    poison = PoisonTorch()
    for mod in (quant_gemm, int_linear, fp8_linear):
        monkeypatch.setattr(mod, "torch", poison)
    return type("Quant", (), dict(quant_gemm=quant_gemm, int_linear=int_linear, fp8_linear=fp8_linear, poison=poison))


@pytest.fixture(scope="module")
def weight_of():
    """One weight per (projection, format), built once for the batches (gate_up's is large)."""
    cache: dict[tuple, list] = {}

    def get(key, build):
        if key not in cache:
            cache.clear()
            cache[key] = build(gen(sum(map(ord, str(key)))))
        return cache[key]

    return get


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("proj", list(PROJECTIONS_7B))
@pytest.mark.parametrize("fmt", list(INT_FORMATS))
def test_int_linear_7b(Q, weight_of, fmt, proj, batch):
    """The launch table's path (GEMV at 1 and 16 rows, GEMM at 64 and 256) at the 7B shapes."""
    (n, k), (bits, group, zeros, mins) = PROJECTIONS_7B[proj], INT_FORMATS[fmt]
    group = group or k
    weight = weight_of((fmt, proj), lambda g: int_weight(n, k, bits, group, zeros, mins, g))
    args = int_case(batch, n, k, bits, group, zeros, mins, proj == "qkv", BF16, gen(batch), weight=weight)
    check_int_linear(Q.int_linear.int_linear, args)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("proj", list(PROJECTIONS_7B))
@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
def test_fp8_linear_7b(Q, weight_of, fmt, proj, batch):
    (n, k), (block_n, block_k, act_group) = PROJECTIONS_7B[proj], FP8_FORMATS[fmt]
    weight = weight_of((fmt, proj), lambda g: fp8_weight(n, k, block_n, block_k, g))
    args = fp8_case(batch, n, k, block_n, block_k, act_group, proj == "qkv", BF16, gen(batch), weight=weight)
    check_fp8_linear(Q.fp8_linear.fp8_linear, args)


@pytest.mark.parametrize("route", ["scaled_mm", "fp8_dot", "bf16_math"])
@pytest.mark.parametrize("fmt", ["channel-w8a8-token", "block-w8a8-g128"])
def test_fp8_w8a8_gemm_routes(Q, fmt, route):
    """Every W8A8 GEMM route at 256 rows (torch._scaled_mm only where its layouts fit)."""
    block_n, block_k, act_group = FP8_FORMATS[fmt]
    n, k = PROJECTIONS_7B["o"]
    args = fp8_case(256, n, k, block_n, block_k, act_group, True, BF16, gen(3))
    cfg = Q.fp8_linear.launch_config(256, n, k, block_n, block_k, act_group, args[0].device)
    if route == "scaled_mm" and not Q.fp8_linear.scaled_mm_fits(n, k, block_n, block_k, act_group, BF16):
        pytest.skip("torch._scaled_mm's rowwise scaling does not fit this layout")
    if route != "bf16_math" and not cfg.fp8_native:
        pytest.skip("no fp8 tensor cores (sm_89+)")
    fields = {"scaled_mm": dict(scaled_mm=True), "fp8_dot": dict(scaled_mm=False, fp8_dot=True),
              "bf16_math": dict(scaled_mm=False, fp8_dot=False, block_k=64)}[route]
    check_fp8_linear(lambda *a: Q.fp8_linear.fp8_linear(*a, config=replace(cfg, **fields)), args)


@pytest.mark.parametrize("fields", [
    dict(gemv=True, use_dot=False, block_m=1, block_n=16, block_k=512, num_warps=4, num_stages=4, waves=8),
    dict(gemv=True, use_dot=False, block_m=1, block_n=64, block_k=128, num_warps=8, num_stages=2, waves=2),
    dict(gemv=True, use_dot=True, block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=3, splits=1),
    dict(gemv=False, use_dot=True, block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3, group_m=4),
    dict(gemv=False, use_dot=True, block_m=128, block_n=256, block_k=32, num_warps=8, num_stages=3),
])
@pytest.mark.parametrize("kind", ["int4", "int8-g32-mins", "fp8-block", "fp8-w8a8-g128"])
def test_configs_off_the_table(Q, kind, fields):
    """Tile shapes a sweep would try, each path, at the 7B down projection (4 rows on the GEMV)."""
    n, k = PROJECTIONS_7B["down"]
    m = 1 if fields["gemv"] and not fields["use_dot"] else 4 if fields["gemv"] else 96
    g = gen(len(fields) + fields["block_k"])
    if kind.startswith("int"):
        bits, group, mins = (4, 128, False) if kind == "int4" else (8, 32, True)
        args = int_case(m, n, k, bits, group, not mins, mins, True, BF16, g)
        cfg = replace(Q.int_linear.launch_config(m, n, k, group, args[0].device), **fields)
        check_int_linear(lambda *a: Q.int_linear.int_linear(*a, config=cfg), args)
    else:
        act_group = 128 if kind.endswith("g128") else -1
        args = fp8_case(m, n, k, 128, 128, act_group, True, BF16, g)
        cfg = replace(Q.fp8_linear.launch_config(m, n, k, 128, 128, act_group, args[0].device), **fields)
        check_fp8_linear(lambda *a: Q.fp8_linear.fp8_linear(*a, config=cfg), args)


@pytest.mark.parametrize("batch", [1, 8, 96])
@pytest.mark.parametrize("bits,group,mins", [(4, 128, False), (4, 32, True), (8, 128, False)])
def test_prmt_unpack_equals_shifts(Q, bits, group, mins, batch):
    """The inline-asm unpacking (prmt) gives the values the shifts and masks give (the same fp32
    weights: outputs equal but for summation order, should the compiler reorder; a wrong byte
    would be an error of order 1)."""
    n, k = PROJECTIONS_7B["o"]
    args = int_case(batch, n, k, bits, group, not mins, mins, True, BF16, gen(bits + group + batch))
    cfg = Q.int_linear.launch_config(batch, n, k, group, args[0].device)
    assert cfg.prmt
    shifts = Q.int_linear.int_linear(*args, config=replace(cfg, prmt=False))
    assert rel_err(Q.int_linear.int_linear(*args, config=cfg), shifts) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("batch", [1, 8, 80])
def test_model_dtypes(Q, dtype, batch):
    """fp16 and fp32 models (fp32: IEEE fp32 dots, no TF32), int4 and fp8 (W8A16, W8A8)."""
    n, k = 1024, 2048
    check_int_linear(Q.int_linear.int_linear, int_case(batch, n, k, 4, 128, True, False, True, dtype, gen(batch)))
    for act_group in (-1, 128):
        check_fp8_linear(Q.fp8_linear.fp8_linear, fp8_case(batch, n, k, 128, 128, act_group, True, dtype, gen(batch)))


def test_act_quant_bit_exact(Q):
    """The fp8 activations and scales of the W8A8 paths, byte for byte with the reference's."""
    from ingot.ops import reference as ref

    x = (torch.randn(64, 18944, generator=gen(4), device=DEVICE) * torch.logspace(-3, 2, 18944, device=DEVICE)).to(BF16)
    for group in (0, 128):
        q, scales = Q.fp8_linear.act_quant(x, group)
        q_ref, s_ref = ref.quantize_fp8_activations(x, group)
        assert torch.equal(scales, s_ref)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def _int_args(batch: int) -> list:
    n, k = PROJECTIONS_7B["o"]
    return int_case(batch, n, k, 4, 128, True, False, True, BF16, gen(batch))


def _fp8_args(batch: int) -> list:
    n, k = PROJECTIONS_7B["o"]
    return fp8_case(batch, n, k, 128, 128, 128, True, BF16, gen(batch))


def test_ops_dispatch_to_the_kernels(Q):
    from ingot.ops import library  # noqa: F401  (defines torch.ops.ingot.*)
    from ingot.ops.triton import register_cuda_kernels

    assert register_cuda_kernels()
    for batch in (1, 64):
        before = Q.poison.allocs
        check_int_linear(torch.ops.ingot.int_linear, _int_args(batch))
        check_fp8_linear(torch.ops.ingot.fp8_linear, _fp8_args(batch))
        assert Q.poison.allocs > before, "the ops did not reach the Triton implementations"


@pytest.mark.parametrize("batch", [1, 4, 64])
@pytest.mark.parametrize("op", ["int", "fp8", "fp8-scaled-mm"])
def test_cuda_graph_replay(Q, op, batch):
    """Captured once (split-K counters and scratch allocated by shape), replayed with new
    activations in the same buffer: each replay equals the eager call."""
    if op == "int":
        args, fn = _int_args(batch), Q.int_linear.int_linear
    else:
        n, k = PROJECTIONS_7B["o"]
        fmt = (1, 0, 0) if op == "fp8-scaled-mm" else (128, 128, 128)
        args, fn = fp8_case(batch, n, k, *fmt, True, BF16, gen(batch)), Q.fp8_linear.fp8_linear
    x = args[0]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=gen(100 + seed), device=DEVICE).to(x.dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fn(*args))
        expected = int_expected(args) if op == "int" else fp8_expected(args)
        assert rel_err(out, expected) < 1e-2


@pytest.mark.parametrize("batch", [1, 64])
def test_torch_compile_opaque(batch):
    """Under torch.compile the ops are single opaque nodes: one graph, no break, the eager result."""
    import torch._dynamo.testing

    from ingot.ops import library  # noqa: F401
    from ingot.ops.triton import register_cuda_kernels

    assert register_cuda_kernels()
    int_args, fp8_args = _int_args(batch), _fp8_args(batch)

    def f(x):
        h = torch.ops.ingot.int_linear(x, *int_args[1:])
        return torch.ops.ingot.fp8_linear(torch.nn.functional.silu(h), *fp8_args[1:])

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=False)
    out = compiled(int_args[0])
    assert counter.frame_count == 1
    targets = [str(node.target) for gm in counter.graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert any("ingot.int_linear" in t for t in targets) and any("ingot.fp8_linear" in t for t in targets), targets
    assert rel_err(out, f(int_args[0])) < 1e-2
