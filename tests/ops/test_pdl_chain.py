"""Programmatic dependent launch (``ingot/ops/triton/pdl.py``): where it is used, and that it
changes no result.

CPU (unmarked): off the GPU (the interpreter, CPU tensors) no kernel asks for PDL; where it
is supported, the launch tables ask for it on the few-row paths only.

GPU (marked cuda; sm_90+): one MoE layer's batch-1 decode chain, each kernel consuming the
previous one's output (GEMV -> decode attention -> o_proj with the router epilogue ->
PyTorch top-k -> fused MoE -> GEMV), captured in a CUDA graph once with the table's
launches (PDL on) and once with PDL off, then replayed back to back on new inputs
without a sync in between. A kernel that read its input before waiting for its producer
would read the previous replay's values; the outputs must match bit for bit (PDL moves
no arithmetic) and the PDL-off chain must match the reference ops.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from ingot.ops import reference as ref
from tests.ops.kernel_cases import paged, rel_err

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
BF16 = torch.bfloat16

# a Qwen3-30B-A3B-like layer, narrowed: hidden 1024, 8 query heads of 128 over 2 KV heads,
# 32 experts of 256, top 4; context 300 tokens in 16-token pages
H, HQ, HKV, D, E, TOP_K, I, CTX, PAGE = 1024, 8, 2, 128, 32, 4, 256, 300, 16


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_no_pdl_off_the_gpu():
    from ingot.ops.triton import decode_attention, fused_moe, skinny_gemm
    from ingot.ops.triton.pdl import pdl_supported

    cpu = torch.device("cpu")
    assert not pdl_supported(cpu)
    assert not skinny_gemm.launch_config(1, 4096, 2048, cpu).pdl
    assert not skinny_gemm.launch_config(1, 2048, 4096, cpu, router=True).pdl
    assert not decode_attention.launch_config(128, 4, cpu).pdl
    assert not fused_moe.launch_config(128, 768, 1, cpu).pdl


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_pdl_on_the_few_row_paths_only(monkeypatch):
    from ingot.ops.triton import decode_attention, fused_moe, skinny_gemm

    for module in (decode_attention, fused_moe, skinny_gemm):
        monkeypatch.setattr(module, "pdl_supported", lambda device: True)
    dev = torch.device("cpu")  # 132 SMs, as an H200
    assert skinny_gemm.launch_config(1, 4096, 2048, dev).pdl and skinny_gemm.launch_config(16, 4096, 2048, dev).pdl
    assert decode_attention.launch_config(128, 4, dev).pdl  # batch 1, 4 KV heads: latency-bound
    assert not decode_attention.launch_config(128, 64 * 8, dev).pdl  # batch 64, 8 KV heads
    assert fused_moe.launch_config(128, 768, 1, dev).pdl  # one token: per pair
    assert not fused_moe.launch_config(128, 768, 64, dev).pdl  # grouped, after its align kernel


def _weights(gen: torch.Generator, device: str = "cuda") -> dict[str, torch.Tensor]:
    def w(*shape, fan_in):
        return (torch.randn(*shape, generator=gen) / fan_in**0.5).to(BF16).to(device)

    k_cache, v_cache, table = paged([CTX], PAGE, HKV, D, BF16, gen, device=device)
    return dict(
        w_q=w(HQ * D, H, fan_in=H), w_o=w(H, HQ * D, fan_in=HQ * D),
        norm=(1 + 0.1 * torch.randn(H, generator=gen)).to(BF16).to(device),
        router=w(E, H, fan_in=H), w_gate_up=w(E, 2 * I, H, fan_in=H), w_down=w(E, H, I, fan_in=I), w_out=w(H, H, fan_in=H),
        k_cache=k_cache, v_cache=v_cache, table=table, seq_lens=torch.tensor([CTX], dtype=torch.int32, device=device),
    )


def _chain(w: dict[str, torch.Tensor], x: torch.Tensor, residual: torch.Tensor, pdl: bool) -> tuple[torch.Tensor, ...]:
    """The layer's kernels in turn (the output, and the routing picked from the router's logits);
    ``pdl`` False: the table's launches with PDL switched off."""
    from ingot.ops.triton import decode_attention, fused_moe, skinny_gemm

    dev = x.device

    def gemv_cfg(n, k, **kw):
        cfg = skinny_gemm.launch_config(1, n, k, dev, **kw)
        return cfg if pdl else replace(cfg, pdl=False)

    q = skinny_gemm.skinny_linear(x, w["w_q"], None, config=gemv_cfg(HQ * D, H))
    attn_cfg = decode_attention.launch_config(D, HKV, dev)
    attn = decode_attention.decode_attention(q.view(1, HQ, D), w["k_cache"], w["v_cache"], w["table"], w["seq_lens"],
                                             D**-0.5, config=attn_cfg if pdl else replace(attn_cfg, pdl=False))
    logits, s, xw, rstd = skinny_gemm.linear_norm_linear_scaled(
        attn.view(1, HQ * D), w["w_o"], None, residual, w["norm"], 1e-6, w["router"], gemv_cfg(H, HQ * D, router=True))
    weights, ids = torch.topk(logits.float().softmax(-1), TOP_K, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(BF16)
    launch = fused_moe.launch_config(E, I, 1, dev)
    moe = fused_moe.run(xw, w["w_gate_up"], w["w_down"], weights, ids, rstd, launch if pdl else replace(launch, pdl=False))
    return skinny_gemm.skinny_linear(moe + s, w["w_out"], None, config=gemv_cfg(H, H)), weights, ids


def _reference(w: dict[str, torch.Tensor], x: torch.Tensor, residual: torch.Tensor, weights: torch.Tensor,
               ids: torch.Tensor) -> torch.Tensor:
    """The same layer through the reference ops, in fp32, with the chain's routing (two experts'
    probabilities within bf16 rounding of each other may rank either way)."""
    f = {k: v.float() if v.is_floating_point() else v for k, v in w.items()}
    q = ref.skinny_linear(x.float(), f["w_q"], None)
    attn = ref.decode_attention(q.view(1, HQ, D), f["k_cache"], f["v_cache"], f["table"], f["seq_lens"], D**-0.5)
    s = ref.skinny_linear(attn.view(1, HQ * D), f["w_o"], None) + residual.float()
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * f["norm"]
    moe = ref.fused_moe(normed, f["w_gate_up"], f["w_down"], weights.float(), ids)
    return ref.skinny_linear(moe + s, f["w_out"], None)


@pytest.mark.cuda
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
def test_pdl_chain_in_a_cuda_graph_matches_the_chain_without_it():
    from ingot.ops.triton.pdl import pdl_supported

    dev = torch.device("cuda")
    if not pdl_supported(dev):
        pytest.skip("PDL needs an sm_90+ GPU")
    gen = torch.Generator().manual_seed(5)
    w = _weights(gen)
    x = torch.empty(1, H, dtype=BF16, device=dev)
    residual = torch.empty(1, H, dtype=BF16, device=dev)
    inputs = [(torch.randn(1, H, generator=gen).to(BF16).cuda(), torch.randn(1, H, generator=gen).to(BF16).cuda())
              for _ in range(12)]
    results = {}
    for pdl in (True, False):
        x.copy_(inputs[0][0])
        residual.copy_(inputs[0][1])
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles the kernels and allocates the split counters
                _chain(w, x, residual, pdl)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, weights, ids = _chain(w, x, residual, pdl)
        outs = []
        for xi, ri in inputs:  # queued back to back: no sync between replays
            x.copy_(xi)
            residual.copy_(ri)
            graph.replay()
            outs.append((out.clone(), weights.clone(), ids.clone()))
        torch.cuda.synchronize()
        results[pdl] = outs
    for i, (on, off) in enumerate(zip(results[True], results[False])):
        assert all(torch.equal(a, b) for a, b in zip(on, off)), f"replay {i}: PDL changed the result"
        assert rel_err(off[0], _reference(w, *inputs[i], *off[1:])) < 2e-2, f"replay {i}"
