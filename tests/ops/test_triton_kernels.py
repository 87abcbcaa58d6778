"""Triton CUDA kernels against ingot.ops.reference (marked cuda; run on the GPU).

Every case builds fresh random inputs; the kernel modules' new tensors start
as NaN (outputs) or junk (scratch, int buffers), so an element a kernel forgets
to write fails the check. Errors are relative L2 against the reference computed
in fp32 from the same bf16 inputs; NaN never passes. Also: dispatch through
``torch.ops.ingot.*`` after ``register_cuda_kernels()``, and decode attention
replayed from a captured CUDA graph with new sequence lengths.

One CPU test (unmarked) checks ``register_cuda_kernels()`` without CUDA.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from ingot.ops import reference as ref
from ingot.ops.triton._common import next_pow2
from tests.ops.kernel_cases import check_linear_norm_router, check_prologue_linear, check_rope_decode, check_store_kv
from tests.ops.kernel_cases import rel_err, rope_decode_case, rope_table
from tests.ops.kernel_cases import mixed_prefill_lens, paged as _paged, prefill_case as _prefill_case


def paged(lens, page, hkv, d, dtype, gen, extra_cols=2, device="cuda"):
    return _paged(lens, page, hkv, d, dtype, gen, extra_cols, device)

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
BF16 = torch.bfloat16
TOL = 1e-2


def gpu(fn):
    fn = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")(fn)
    fn = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")(fn)
    return pytest.mark.cuda(fn)


# ----------------------------------------------------------------------------- helpers
class PoisonTorch:
    """``torch`` as seen by a kernel module: new tensors pre-filled with NaN / junk;
    counts allocations (proof that a dispatched op ran the Triton path)."""

    def __init__(self):
        self.allocs = 0

    def __getattr__(self, name):
        return getattr(torch, name)

    def _poison(self, t):
        self.allocs += 1
        return t.fill_(float("nan") if t.is_floating_point() else -77)

    def empty(self, *args, **kwargs):
        return self._poison(torch.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs):
        return self._poison(torch.empty_like(*args, **kwargs))


@pytest.fixture
def K(monkeypatch):
    """The kernel modules with poisoned allocations."""
    from ingot.ops.triton import (
        activation, decode_attention, kv_store, prefill_attention, prefill_dispatch, rms_norm, rotary, skinny_gemm,
    )

    mods = dict(activation=activation, decode_attention=decode_attention, kv_store=kv_store,
                prefill_attention=prefill_attention, prefill_dispatch=prefill_dispatch, rms_norm=rms_norm,
                rotary=rotary, skinny_gemm=skinny_gemm)
    poison = PoisonTorch()
    for mod in mods.values():
        monkeypatch.setattr(mod, "torch", poison)
    return type("Kernels", (), dict(mods, poison=poison))




def mismatch(out: torch.Tensor, expected: torch.Tensor) -> float:
    """Fraction of elements that differ bit-wise."""
    return (out != expected).float().mean().item()




def random_lens(batch, max_len, gen):
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
    # some edge lengths (a padding row, a block boundary, one past it, one past a
    # 64-token tile); the last row stays random so batch 1 gets a long context
    for i, n in enumerate([1, 16, 17, 2 * 64 + 1]):
        if i < batch - 1 and n <= max_len:
            lens[i] = n
    return lens


def prefill_case(q_lens, ctx_lens, hq, hkv, d, page, gen, dtype=BF16):
    """Packed new tokens whose k/v are already stored in the cache; the op's arguments."""
    return _prefill_case(q_lens, ctx_lens, hq, hkv, d, page, gen, dtype, device="cuda", extra_cols=2)


def fp32(args):
    return [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


# ----------------------------------------------------------------------------- CPU
def test_register_without_cuda_does_not_raise_or_import_triton():
    code = (
        "import sys; from ingot.ops.triton import register_cuda_kernels as r; "
        "ok = r(); print(ok, 'triton' in sys.modules)"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False"]


def test_register_in_process_does_not_raise():
    from ingot.ops.triton import register_cuda_kernels

    assert register_cuda_kernels() in (True, False)
    if not HAS_CUDA:
        assert register_cuda_kernels() is False


# ----------------------------------------------------------------------------- decode
GQA = [(8, 8), (32, 8), (28, 4), (16, 2)]  # ratios 1, 4, 7, 8


@gpu
@pytest.mark.parametrize("batch", [1, 3, 17, 64, 256])
@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("d", [64, 128])
def test_decode_attention(K, batch, hq, hkv, d):
    gen = torch.Generator().manual_seed(batch * 1000 + hq * 10 + d)
    max_len = 700 if batch <= 64 else 300
    lens = random_lens(batch, max_len, gen) if batch > 1 else [max_len - 3]  # B=1: many splits
    k_cache, v_cache, table = paged(lens, 16, hkv, d, BF16, gen)
    q = torch.randn(batch, hq, d, generator=gen).to(BF16).cuda()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = d**-0.5
    out = K.decode_attention.decode_attention(q, k_cache, v_cache, table, seq_lens, scale)
    expected = ref.decode_attention(q.float(), k_cache.float(), v_cache.float(), table, seq_lens, scale)
    assert out.dtype == BF16
    assert rel_err(out, expected) < TOL


@gpu
@pytest.mark.parametrize("splits", [1, 2, 5, 64])
@pytest.mark.parametrize("d,page", [(128, 16), (256, 16), (64, 64), (128, 1)])
def test_decode_attention_splits(K, splits, d, page):
    gen = torch.Generator().manual_seed(splits + d + page)
    lens = [1, 1000, 63, 64, 65, 500, 2]
    k_cache, v_cache, table = paged(lens, page, 2, d, BF16, gen)
    q = torch.randn(len(lens), 8, d, generator=gen).to(BF16).cuda()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = K.decode_attention.decode_attention(q, k_cache, v_cache, table, seq_lens, d**-0.5, num_splits=splits)
    expected = ref.decode_attention(q.float(), k_cache.float(), v_cache.float(), table, seq_lens, d**-0.5)
    assert rel_err(out, expected) < TOL


@gpu
def test_decode_attention_zero_lengths_are_finite(K):
    """Graph warm-up runs on zeroed buffers: seq_len 0 must give zeros, not NaN or a fault."""
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, table = paged([40, 40], 16, 2, 128, BF16, gen)
    q = torch.randn(2, 8, 128, generator=gen).to(BF16).cuda()
    zeros = torch.zeros(2, dtype=torch.int32, device="cuda")
    for splits in (1, 4):
        out = K.decode_attention.decode_attention(q, k_cache, v_cache, table * 0, zeros, 0.1, num_splits=splits)
        torch.cuda.synchronize()
        assert (out == 0).all()


@gpu
def test_decode_attention_cuda_graph_replay(K):
    """Captured once, replayed with other lengths (and block tables) in the same buffers."""
    gen = torch.Generator().manual_seed(11)
    batch, hq, hkv, d, page, max_blocks = 12, 28, 4, 128, 16, 40
    nb = batch * max_blocks + 1
    k_cache = torch.randn(nb, page, hkv, d, generator=gen).to(BF16).cuda()
    v_cache = torch.randn(nb, page, hkv, d, generator=gen).to(BF16).cuda()
    q = torch.empty(batch, hq, d, dtype=BF16, device="cuda")
    table = torch.zeros(batch, max_blocks, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(batch, dtype=torch.int32, device="cuda")

    def fill(lens):
        perm = torch.randperm(nb - 1, generator=gen)[: batch * max_blocks].view(batch, max_blocks) + 1
        table.copy_(perm.to(torch.int32))
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(batch, hq, d, generator=gen).to(BF16))

    def run():
        return K.decode_attention.decode_attention(q, k_cache, v_cache, table, seq_lens, d**-0.5)

    fill([5] * batch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for lens in ([1] * batch, random_lens(batch, max_blocks * page, gen), [max_blocks * page] * batch):
        fill(lens)
        graph.replay()
        torch.cuda.synchronize()
        expected = ref.decode_attention(q.float(), k_cache.float(), v_cache.float(), table, seq_lens, d**-0.5)
        assert rel_err(out, expected) < TOL, lens


@gpu
@pytest.mark.parametrize("batch", [1, 8, 64, 256])
@pytest.mark.parametrize("hq,hkv", GQA)
def test_decode_attention_rope_with_head_norms(K, batch, hq, hkv):
    """Qwen3's q/k norm folded into the fused decode kernel (head dim 128), against the reference ops."""
    gen = torch.Generator().manual_seed(batch * 11 + hq)
    lens = random_lens(batch, 600, gen) if batch > 1 else [513]
    if batch > 1:
        lens[-1] = 1
    args = rope_decode_case(lens, hq, hkv, 128, 16, BF16, gen, device="cuda", pad_row=batch > 1, qk_norm=True)
    check_rope_decode(K.decode_attention.decode_attention_rope, args)


@gpu
@pytest.mark.parametrize("batch", [1, 3, 17, 64, 256])
@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("d", [64, 128])
def test_decode_attention_rope(K, batch, hq, hkv, d):
    """Fused rotary + KV store + attention against the three reference ops; the new
    token's slot starts as NaN, so a program reading it from the cache fails."""
    gen = torch.Generator().manual_seed(batch * 7 + hq + d)
    lens = random_lens(batch, 700 if batch <= 64 else 300, gen) if batch > 1 else [677]
    if batch > 1:
        lens[-1] = 1  # the graph padding row
    args = rope_decode_case(lens, hq, hkv, d, 16, BF16, gen, device="cuda", pad_row=batch > 1)
    check_rope_decode(K.decode_attention.decode_attention_rope, args)
    from ingot.ops.triton import _common

    counters = _common._counters.get(torch.device("cuda", torch.cuda.current_device()))
    assert counters is None or int(counters.count_nonzero()) == 0  # reset for the next call


@gpu
@pytest.mark.parametrize("splits", [1, 2, 7, 64])
@pytest.mark.parametrize("tiles", ["batch 64", "batch 1"])
def test_decode_attention_rope_splits(K, splits, tiles):
    """Split counts from direct write to 64 (mostly empty slices at these lengths), with
    both tile configurations of the launch table."""
    gen = torch.Generator().manual_seed(splits)
    lens = [1000, 129, 128, 65, 64, 17, 2, 1]  # new token first / last of a 64- or 128-token tile
    args = rope_decode_case(lens, 28, 4, 128, 16, BF16, gen, device="cuda")
    programs = {"batch 64": 64 * 4, "batch 1": 4}[tiles]
    cfg = K.decode_attention.launch_config(128, programs, torch.device("cuda"))
    check_rope_decode(lambda *a: K.decode_attention.decode_attention_rope(*a, num_splits=splits, config=cfg), args)


@gpu
def test_decode_merge_kernel_fallback(K):
    gen = torch.Generator().manual_seed(4)
    args = rope_decode_case([900, 33, 1], 12, 2, 128, 16, BF16, gen, device="cuda")
    cfg = replace(K.decode_attention.launch_config(128, 3 * 2, torch.device("cuda")), merge_kernel=True)
    check_rope_decode(lambda *a: K.decode_attention.decode_attention_rope(*a, num_splits=6, config=cfg), args)


@gpu
@pytest.mark.parametrize("block_n,warps,stages", [(32, 4, 2), (64, 4, 3), (128, 8, 4)])
def test_decode_attention_sweep_configs(K, block_n, warps, stages):
    """Tile configurations the decode sweep (benchmarks/kernels.py --sweep decode) may pick."""
    gen = torch.Generator().manual_seed(block_n + warps)
    args = rope_decode_case([700, 129, 64, 1], 12, 2, 128, 16, BF16, gen, device="cuda")
    cfg = K.decode_attention.DecodeConfig(block_n, warps, stages, waves=2)
    check_rope_decode(lambda *a: K.decode_attention.decode_attention_rope(*a, config=cfg), args)


# ----------------------------------------------------------------------------- store_kv
@gpu
@pytest.mark.parametrize("t,hkv,d", [(1, 8, 128), (37, 4, 128), (300, 2, 64), (64, 8, 256)])
def test_store_kv(K, t, hkv, d):
    gen = torch.Generator().manual_seed(t + hkv + d)
    check_store_kv(K.kv_store.store_kv, t, hkv, d, page=16, nb=t // 16 + 8, gen=gen, device="cuda", dtype=BF16)


# ----------------------------------------------------------------------------- norms, act, rotary
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


# ----------------------------------------------------------------------------- skinny GEMM
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
    out = K.skinny_gemm.skinny_linear(x, w, None, cfg)
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


# ----------------------------------------------------------------------------- prefill
PREFILL_CASES = [
    # (q_lens, ctx_lens, Hq, Hkv, D)
    ([1], [1], 8, 8, 128),
    ([5], [5], 8, 8, 64),
    ([129, 3, 17, 256], [129, 3, 17, 256], 28, 4, 128),
    ([300, 77], [300, 77], 32, 8, 128),
    ([60, 9, 1], [200, 49, 513], 16, 2, 64),  # chunked prefill: cached prefixes
    ([128, 128], [640, 129], 28, 4, 128),
    ([1000], [1000], 14, 2, 64),
    ([33] * 16, [33 + 7 * i for i in range(16)], 28, 4, 128),
    ([70], [100], 8, 2, 256),
]


@gpu
@pytest.mark.parametrize("q_lens,ctx_lens,hq,hkv,d", PREFILL_CASES)
def test_prefill_attention(K, q_lens, ctx_lens, hq, hkv, d):
    gen = torch.Generator().manual_seed(sum(q_lens) + sum(ctx_lens) + hq)
    args = prefill_case(q_lens, ctx_lens, hq, hkv, d, 16, gen)
    scale = d**-0.5
    out = K.prefill_attention.prefill_attention(*args, scale)  # the launch table's configuration
    expected = ref.prefill_attention(*fp32(args), scale)
    assert out.dtype == BF16
    assert rel_err(out, expected) < TOL


# PrefillConfig fields (block_m, block_n, num_warps, num_stages, block_n_ctx, ctx_stages) by head dim:
# the launch table's entries, and tiles off it (a separate cached-prefix tile and pipeline, smaller tiles)
PREFILL_TILES = {
    128: [(128, 128, 8, 3, None, 5), (128, 64, 8, 3, None, None), (128, 64, 8, 3, 128, 5), (64, 64, 4, 3, None, 5)],
    64: [(128, 64, 4, 3, None, None), (128, 128, 8, 3, None, 5)],
}


@gpu
@pytest.mark.parametrize("hq,hkv,d", [(28, 4, 128), (28, 4, 64)])
def test_prefill_attention_tile_configs(K, hq, hkv, d):
    """The launch table's tile configurations and a few others are correct, in the fused kernel
    and in the context kernel."""
    gen = torch.Generator().manual_seed(9 + d)
    args = prefill_case([200, 31, 1], [260, 31, 90], hq, hkv, d, 16, gen)
    expected = ref.prefill_attention(*fp32(args), d**-0.5)
    configs = [K.prefill_attention.PrefillConfig(*tiles) for tiles in PREFILL_TILES[d]]
    assert K.prefill_attention.launch_config(d, args[0].device) in configs
    for cfg in configs:
        out = K.prefill_attention.prefill_attention(*args, d**-0.5, config=cfg)
        assert rel_err(out, expected) < TOL, cfg
        if K.prefill_dispatch.path_supported("flash", 232, 3, args[7].shape[1] * 16, hq, hkv, d, BF16, args[0].device):
            out = K.prefill_dispatch.prefill_attention(*args, d**-0.5, path="flash", config=cfg)
            assert rel_err(out, expected) < TOL, ("context kernel", cfg)


# (batch, max new tokens, max cached tokens, Hq, Hkv, D)
PREFILL_PATH_CASES = [
    (6, 300, 700, 8, 8, 128),  # GQA ratio 1
    (7, 200, 1200, 28, 4, 128),  # ratio 7 (the 7B shape)
    (5, 150, 400, 14, 2, 64),  # ratio 7, head dim 64
    (3, 700, 300, 16, 4, 64),  # ratio 4
    (9, 64, 2000, 12, 2, 128),  # ratio 6 (the 1.5B shape), short chunks after long prefixes
]


def _supported(K, path, args):
    q, k, cache, table = args[0], args[1], args[3], args[7]
    return K.prefill_dispatch.path_supported(
        path, q.shape[0], table.shape[0], table.shape[1] * cache.shape[1], q.shape[1], k.shape[1], q.shape[2], q.dtype, q.device,
    )


@gpu
@pytest.mark.parametrize("path", ["triton", "flash", "gather"])
@pytest.mark.parametrize("batch,max_new,max_ctx,hq,hkv,d", PREFILL_PATH_CASES)
def test_prefill_paths(K, path, batch, max_new, max_ctx, hq, hkv, d):
    """Each prefill path on random lengths, sequences with and without a cached prefix mixed
    in one call (PyTorch's flash kernel for real; its log-sum-exp read by the context kernel)."""
    gen = torch.Generator().manual_seed(batch * 1000 + max_new + hq + d)
    q_lens, ctx_lens = mixed_prefill_lens(batch, max_new, max_ctx, gen)
    args = prefill_case(q_lens, ctx_lens, hq, hkv, d, 16, gen)
    if not _supported(K, path, args):
        pytest.skip(f"{path} cannot run here (prefill_dispatch.path_supported)")
    out = K.prefill_dispatch.prefill_attention(*args, d**-0.5, path=path)
    assert out.dtype == BF16 and out.shape == args[0].shape
    assert rel_err(out, ref.prefill_attention(*fp32(args), d**-0.5)) < TOL


@gpu
@pytest.mark.parametrize("hq,hkv,d", [(28, 4, 128), (12, 2, 64)])
def test_prefill_flash_path_mostly_new_batch(K, hq, hkv, d):
    """Mostly new tokens with a few short cached prefixes: the context kernel runs one wave of
    programs, each looping over several query tiles (its LOOP variant)."""
    gen = torch.Generator().manual_seed(hq + d)
    args = prefill_case([900, 700, 1000, 500], [900, 716, 1000, 600], hq, hkv, d, 16, gen)
    cap = args[7].shape[1] * 16
    assert 2 * 3100 >= 4 * cap  # "mostly new": PREFILL_RULES' class, and the context kernel's one wave
    groups = K.prefill_attention.context_tile_groups(min(3100, cap), 4, hq, 128, 1, args[0].device)
    assert groups < -(-min(3100, cap) // 128)  # programs take several tiles
    if not _supported(K, "flash", args):
        pytest.skip("flash cannot run here (prefill_dispatch.path_supported)")
    out = K.prefill_dispatch.prefill_attention(*args, d**-0.5, path="flash")
    assert rel_err(out, ref.prefill_attention(*fp32(args), d**-0.5)) < TOL


@gpu
@pytest.mark.parametrize("q_len,ctx_len,extra_cols", [(1000, 1000, 2), (300, 2000, 2), (2, 100, 2), (129, 129, 2),
                                                      (512, 4096, 2), (1024, 1024, 0)])
@pytest.mark.parametrize("hq,hkv,d", [(28, 4, 128), (8, 8, 64), (7, 1, 128)])
def test_prefill_cudnn_path(K, q_len, ctx_len, extra_cols, hq, hkv, d):
    """One sequence through PyTorch's cuDNN attention (then the context kernel), with and
    without a cached prefix; and a prompt filling its block-table row (nothing can be
    cached: cuDNN's inference kernel, no context kernel)."""
    gen = torch.Generator().manual_seed(q_len + ctx_len + hq)
    args = _prefill_case([q_len], [ctx_len], hq, hkv, d, 16, gen, BF16, device="cuda", extra_cols=extra_cols)
    if not _supported(K, "cudnn", args):
        pytest.skip("cuDNN attention cannot run here (prefill_dispatch.path_supported)")
    out = K.prefill_dispatch.prefill_attention(*args, d**-0.5, path="cudnn")
    assert rel_err(out, ref.prefill_attention(*fp32(args), d**-0.5)) < TOL


@gpu
@pytest.mark.parametrize("num_seqs,length", [(8, 512), (2, 256), (3, 1024)])
@pytest.mark.parametrize("hq,hkv,d", [(28, 4, 128), (8, 8, 64), (7, 1, 128)])
def test_prefill_cudnn_path_equal_prompts(K, num_seqs, length, hq, hkv, d):
    """Prompts of one length, a multiple of 256, each filling its block-table row: one dense
    [B, H, L, D] cuDNN call, the path the rule picks for them."""
    gen = torch.Generator().manual_seed(num_seqs + length + hq)
    args = _prefill_case([length] * num_seqs, [length] * num_seqs, hq, hkv, d, 16, gen, BF16, device="cuda", extra_cols=0)
    if not _supported(K, "cudnn", args):
        pytest.skip("cuDNN attention cannot run here (prefill_dispatch.path_supported)")
    assert K.prefill_dispatch.choose_prefill_path(length * num_seqs, num_seqs, length, hq, hkv, d, BF16, args[0].device) == "cudnn"
    out = K.prefill_dispatch.prefill_attention(*args, d**-0.5)
    assert rel_err(out, ref.prefill_attention(*fp32(args), d**-0.5)) < TOL


@gpu
@pytest.mark.parametrize("path", ["triton", "flash", "cudnn", "gather"])
def test_prefill_op_follows_the_rule(K, monkeypatch, path):
    """torch.ops.ingot.prefill_attention runs the path PREFILL_RULES names (spied on)."""
    from ingot.ops import library  # noqa: F401  (defines torch.ops.ingot.*)
    from ingot.ops.triton import register_cuda_kernels

    assert register_cuda_kernels() is True
    pd = K.prefill_dispatch
    gen = torch.Generator().manual_seed(77)
    args = prefill_case([700], [900], 28, 4, 128, 16, gen)
    if not _supported(K, path, args):
        pytest.skip(f"{path} cannot run here")
    monkeypatch.setattr(pd, "PREFILL_RULES", {key: pd.PathRule(path) for key in pd.PREFILL_RULES})
    calls = []
    for name in ("flash_varlen", "cudnn_sdpa", "gather_paged_kv"):
        real = getattr(pd, name)
        monkeypatch.setattr(pd, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    out = torch.ops.ingot.prefill_attention(*args, 128**-0.5)
    expected_calls = {"triton": [], "flash": ["flash_varlen"], "cudnn": ["cudnn_sdpa"],
                      "gather": ["gather_paged_kv", "flash_varlen"]}[path]
    assert calls == expected_calls
    assert rel_err(out, ref.prefill_attention(*fp32(args), 128**-0.5)) < TOL


# ----------------------------------------------------------------------------- dispatch
@gpu
def test_ops_dispatch_to_triton(K):
    from ingot.ops import library  # noqa: F401  (defines torch.ops.ingot.*)
    from ingot.ops.triton import register_cuda_kernels

    assert register_cuda_kernels() is True
    assert register_cuda_kernels() is True  # idempotent
    ops = torch.ops.ingot
    gen = torch.Generator().manual_seed(21)
    poison = K.poison

    def ran_triton(fn):
        before = poison.allocs
        result = fn()
        assert poison.allocs > before, "the op did not reach the Triton implementation"
        return result

    x = torch.randn(9, 512, generator=gen).to(BF16).cuda()
    r = torch.randn(9, 512, generator=gen).to(BF16).cuda()
    w = torch.randn(512, generator=gen).to(BF16).cuda()
    assert rel_err(ran_triton(lambda: ops.rms_norm(x, w, 1e-6)), ref.rms_norm(x, w, 1e-6)) < TOL
    out, res = ran_triton(lambda: ops.add_rms_norm(x, r, w, 1e-6))
    exp_out, exp_res = ref.add_rms_norm(x, r, w, 1e-6)
    assert rel_err(out, exp_out) < TOL and torch.equal(res, exp_res)
    gu = torch.randn(9, 1024, generator=gen).to(BF16).cuda()
    assert rel_err(ran_triton(lambda: ops.silu_and_mul(gu)), ref.silu_and_mul(gu)) < TOL

    q = torch.randn(9, 8, 64, generator=gen).to(BF16).cuda()
    k = torch.randn(9, 2, 64, generator=gen).to(BF16).cuda()
    cache = torch.randn(64, 64, generator=gen).cuda()
    pos = torch.randint(0, 64, (9,), generator=gen).cuda()
    qo, ko = ran_triton(lambda: ops.rotary_embedding(pos, q, k, cache))
    qe, ke = ref.rotary_embedding(pos, q, k, cache)
    assert rel_err(qo, qe) < TOL and rel_err(ko, ke) < TOL

    # store_kv allocates nothing: check its effect instead
    kc = torch.zeros(4, 16, 2, 64, dtype=BF16, device="cuda")
    vc = kc.clone()
    slots = torch.arange(16, 25, device="cuda")
    ops.store_kv(k, k, kc, vc, slots)
    assert torch.equal(kc.view(-1, 2, 64)[16:25], k) and torch.equal(vc.view(-1, 2, 64)[16:25], k)

    args = prefill_case([20, 7], [50, 7], 8, 2, 64, 16, gen)
    out = ran_triton(lambda: ops.prefill_attention(*args, 0.125))
    assert rel_err(out, ref.prefill_attention(*fp32(args), 0.125)) < TOL

    kc, vc, table = paged([70, 1, 33], 16, 2, 64, BF16, gen)
    qd = torch.randn(3, 8, 64, generator=gen).to(BF16).cuda()
    sl = torch.tensor([70, 1, 33], dtype=torch.int32, device="cuda")
    out = ran_triton(lambda: ops.decode_attention(qd, kc, vc, table, sl, 0.125))
    assert rel_err(out, ref.decode_attention(qd.float(), kc.float(), vc.float(), table, sl, 0.125)) < TOL

    args = rope_decode_case([70, 33, 1], 8, 2, 64, 16, BF16, gen, device="cuda")
    check_rope_decode(lambda *a: ran_triton(lambda: ops.decode_attention_rope(*a)), args)


# ----------------------------------------------------------------------------- sliding window, soft-cap
@gpu
@pytest.mark.parametrize("d,window,softcap", [(128, 1024, 0.0), (256, 512, 50.0), (256, 0, 50.0)])
def test_window_softcap_kernels(K, d, window, softcap):
    """Mistral's and Gemma's head dims and windows in bf16: decode at batch 1 and 8, a chunked
    prefill straddling the window; against the dense masked softmax (window_cases.py)."""
    from tests.ops.window_cases import decode_window_case, prefill_window_case

    gen = torch.Generator().manual_seed(d + window)
    for lens in ([3000], [3000, 300, 1025, 1, 2000, 1100, 64, 2500]):
        args, expected = decode_window_case(lens, 16, 8, d, 16, gen, BF16)
        out = K.decode_attention.decode_attention(*[a.cuda() for a in args], d**-0.5, window, softcap)
        assert rel_err(out.cpu(), expected(window, d**-0.5, softcap)) < TOL
    args, expected = prefill_window_case([300, 100], [2300, 100], 16, 8, d, 16, gen, BF16)
    out = K.prefill_dispatch.prefill_attention(*[a.cuda() for a in args], d**-0.5, window, softcap)
    assert rel_err(out.cpu(), expected(window, d**-0.5, softcap)) < TOL
