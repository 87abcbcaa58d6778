"""Triton decode attention on the GPU (marked cuda) against ingot.ops.reference: plain, with
rotary + KV store fused in, split counts, tile configurations, CUDA-graph replay, and sliding
windows with soft-capping."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ingot.ops import reference as ref
from tests.ops.gpu_fixtures import BF16, TOL, K, gpu, paged  # noqa: F401  (K: the fixture)
from tests.ops.kernel_cases import check_rope_decode, rel_err, rope_decode_case


def random_lens(batch, max_len, gen):
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
    # some edge lengths (a padding row, a block boundary, one past it, one past a
    # 64-token tile); the last row stays random so batch 1 gets a long context
    for i, n in enumerate([1, 16, 17, 2 * 64 + 1]):
        if i < batch - 1 and n <= max_len:
            lens[i] = n
    return lens


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
@pytest.mark.parametrize("splits", [1, 3, 64])
@pytest.mark.parametrize("tiles", ["batch 64", "batch 1"])
def test_fused_decode_equals_its_three_kernels(K, splits, tiles):
    """The fused step attends its new token inside its tile, as a cached one (probability
    rounded for the PV dot): bit for bit what rotary + store_kv + decode_attention give with
    the same slices, so a verify step's rows (the three ops) pick what decode steps pick."""
    gen = torch.Generator().manual_seed(40 + splits)
    lens = [1000, 129, 128, 65, 64, 17, 2, 1]
    args = rope_decode_case(lens, 28, 4, 128, 16, BF16, gen, device="cuda", pad_row=False)
    q, k, v, positions, cos_sin, k_cache, v_cache, slots, table, seq_lens, scale = args
    programs = {"batch 64": 64 * 4, "batch 1": 4}[tiles]
    cfg = K.decode_attention.launch_config(128, programs, torch.device("cuda"))
    fused = K.decode_attention.decode_attention_rope(*args, num_splits=splits, config=cfg)
    k_cache2, v_cache2 = k_cache.clone(), v_cache.clone()
    q_rot, k_rot = K.rotary.rotary_embedding(positions, q, k, cos_sin)
    K.kv_store.store_kv(k_rot, v, k_cache2, v_cache2, slots)
    apart = K.decode_attention.decode_attention(q_rot, k_cache2, v_cache2, table, seq_lens, scale, num_splits=splits,
                                                config=cfg)
    assert torch.equal(k_cache.nan_to_num(7.0), k_cache2.nan_to_num(7.0))
    assert torch.equal(fused, apart)


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
