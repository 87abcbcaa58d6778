"""Triton prefill attention and each path of the prefill dispatch on the GPU (marked cuda)
against ingot.ops.reference: the fused kernel's tiles, PyTorch's flash and cuDNN attention with
the context kernel, the gather path, and the op following ``PREFILL_RULES``."""

from __future__ import annotations

import pytest
import torch

from ingot.ops import reference as ref
from tests.ops.gpu_fixtures import BF16, TOL, K, fp32, gpu, prefill_case  # noqa: F401  (K: the fixture)
from tests.ops.kernel_cases import mixed_prefill_lens, rel_err
from tests.ops.kernel_cases import prefill_case as _prefill_case

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
