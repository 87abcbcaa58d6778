"""The prefill op's CUDA dispatch (ops/triton/prefill_dispatch.py): its host logic on CPU.

The launch rule, path support, the paged-KV gather and the varlen bounds it hands
PyTorch's attention, against ingot.ops.reference. PyTorch's flash and cuDNN kernels
run only on a GPU, so here CPU stand-ins of the same contract take their place
(``tests/ops/kernel_cases.py``: they assert the bounds flash relies on); the Triton
context kernel these paths pair with runs in test_prefill_interpret.py, the real
kernels in test_prefill_kernels_cuda.py (cuda).
"""

from __future__ import annotations

import pytest
import torch

from ingot.ops import reference as ref
from ingot.ops.triton import prefill_dispatch as pd
from tests.ops.kernel_cases import (
    cudnn_sdpa_reference, mixed_prefill_lens, paged, prefill_case, rel_err, varlen_attention_reference,
)

BF16 = torch.bfloat16
CUDA = torch.device("cuda")  # a device object only: nothing runs on it here


def fp32(args):
    return [a.float() if a.is_floating_point() else a for a in args]


# ----------------------------------------------------------------------------- the rule
def test_prefill_class():
    assert pd.prefill_class(4096, 1, 4096) == (True, True)  # one prompt, no cached prefix
    assert pd.prefill_class(512, 1, 2048) == (True, False)  # a chunk after 1536 cached tokens
    assert pd.prefill_class(8 * 512, 8, 2048) == (False, False)  # kernels.py's chunked case
    assert pd.prefill_class(8 * 512, 8, 512) == (True, True)  # 8 prompts of 512: one dense [8, 512] block
    assert pd.prefill_class(8 * 496, 8, 496) == (False, True)  # one length, not a multiple of 256
    assert pd.prefill_class(8 * 500, 8, 512) == (False, True)  # lengths unknown: rows not filled
    assert pd.prefill_class(1024, 8, 256) == (False, True)  # half the capacity: still "new"


def test_dense_block_from_shapes_alone():
    assert pd.fills_rows(8 * 512, 8, 512) and not pd.fills_rows(8 * 512 - 1, 8, 512)
    assert pd.dense_block(17, 1, 4096)  # one sequence, with or without a cached prefix
    assert pd.dense_block(4 * 256, 4, 256) and pd.dense_block(2 * 1024, 2, 1024)
    assert not pd.dense_block(4 * 128, 4, 128)  # one length, but cuDNN would need a plan per such length
    assert not pd.dense_block(4 * 256, 4, 512)  # some sequence has a cached prefix or a shorter prompt


@pytest.fixture
def everything_supported(monkeypatch):
    monkeypatch.setattr(pd, "capability", lambda device: (9, 0))
    monkeypatch.setattr(pd, "flash_available", lambda: True)
    monkeypatch.setattr(pd, "cudnn_available", lambda: True)
    monkeypatch.setattr(pd, "_aten_args", lambda name: frozenset({"seqused_k", "cum_seq_q", "attn_bias"}))


def test_measured_rule_sends_one_long_prompt_to_cudnn_and_keeps_the_fused_kernel_elsewhere(everything_supported):
    """The measured rule (kernels-prefill-*-2026-12-01.json): one prompt of 256 tokens or more
    without a cached prefix, or prompts of one length that is a multiple of 256, run cuDNN;
    shorter ones, cached context and other mostly-new prompts of 256 tokens or more on
    average run the fused kernel (only shorter ones go to flash)."""
    for shape in ((4096, 1, 4096), (4001, 1, 4016), (256, 1, 256), (8 * 512, 8, 512), (2 * 1024, 2, 1024)):
        assert pd.choose_prefill_path(*shape, 28, 4, 128, BF16, CUDA) == "cudnn"
    for shape in ((255, 1, 256), (512, 1, 2048), (4096, 8, 2048), (8 * 496, 8, 496), (4000, 8, 512), (1, 1, 16)):
        assert pd.choose_prefill_path(*shape, 28, 4, 128, BF16, CUDA) == "triton"


def test_the_rule_falls_back_to_the_fused_kernel_without_cudnn(everything_supported, monkeypatch):
    monkeypatch.setattr(pd, "cudnn_available", lambda: False)
    assert pd.choose_prefill_path(4096, 1, 4096, 28, 4, 128, BF16, CUDA) == "triton"
    assert pd.choose_prefill_path(4096, 1, 4096, 28, 4, 128, torch.float32, CUDA) == "triton"


def test_rule_picks_by_class_and_tokens_per_sequence(everything_supported):
    rules = {
        (True, True): pd.PathRule("cudnn", min_tokens_per_seq=256),
        (True, False): pd.PathRule("gather"),
        (False, True): pd.PathRule("flash", min_tokens_per_seq=128),
        (False, False): pd.PathRule("triton"),
    }

    def choose(t, b, cap):
        return pd.choose_prefill_path(t, b, cap, 28, 4, 128, BF16, CUDA, rules)

    assert choose(4096, 1, 4096) == "cudnn"
    assert choose(200, 1, 208) == "triton"  # below the rule's tokens per sequence
    assert choose(512, 1, 2048) == "gather"
    assert choose(8 * 512, 8, 512) == "cudnn"  # one dense block
    assert choose(8 * 496, 8, 496) == "flash"
    assert choose(8 * 100, 8, 112) == "triton"  # 100 new tokens per sequence < 128
    assert choose(8 * 512, 8, 2048) == "triton"


def test_rule_falls_back_where_a_path_cannot_run(everything_supported):
    rules = {key: pd.PathRule("cudnn") for key in pd.PREFILL_RULES}
    assert pd.choose_prefill_path(4096, 1, 4096, 28, 4, 128, BF16, CUDA, rules) == "cudnn"
    assert pd.choose_prefill_path(4096, 2, 4096, 28, 4, 128, BF16, CUDA, rules) == "triton"  # cuDNN: one dense block
    assert pd.choose_prefill_path(4096, 2, 2048, 28, 4, 128, BF16, CUDA, rules) == "cudnn"
    assert pd.choose_prefill_path(4096, 1, 4096, 28, 4, 128, torch.float32, CUDA, rules) == "triton"
    assert pd.choose_prefill_path(4096, 1, 4096, 28, 4, 128, BF16, torch.device("cpu"), rules) == "triton"


@pytest.mark.parametrize("path", ["flash", "cudnn", "gather"])
def test_path_supported(everything_supported, monkeypatch, path):
    def ok(t=512, b=1, cap=512, hq=28, hkv=4, d=128, dtype=BF16, device=CUDA):
        return pd.path_supported(path, t, b, cap, hq, hkv, d, dtype, device)

    assert ok()
    assert not ok(device=torch.device("cpu"))
    assert not ok(dtype=torch.float32)  # flash and cuDNN: fp16 / bf16 only
    assert ok(dtype=torch.float16)
    assert not ok(d=100)  # head dims that are multiples of 8
    assert not ok(hq=10, hkv=4)
    assert ok(hq=28, hkv=4) and ok(hq=7, hkv=1) and ok(hq=8, hkv=8)
    assert ok(d=256) == (path != "cudnn")
    assert ok(b=2, t=1024, cap=1024) == (path != "cudnn")  # two sequences of unknown lengths
    assert ok(b=2, t=1024, cap=512)  # two prompts of 512: one dense block
    assert ok(b=4, t=512, cap=128) == (path != "cudnn")  # of 128: no plan per such length
    assert ok(t=1) == (path != "cudnn")  # cuDNN needs two keys
    if path == "gather":  # the gathered copy stays under GATHER_MAX_BYTES
        assert ok(b=32, t=4096, cap=4096, hkv=4, d=128)  # K and V: 256 MiB exactly
        assert not ok(b=33, t=4096, cap=4096, hkv=4, d=128)
    monkeypatch.setattr(pd, "capability", lambda device: (7, 5))
    assert not ok()
    assert pd.path_supported("triton", 1, 1, 16, 2, 2, 48, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown prefill path"):
        pd.path_supported("fa3", 1, 1, 16, 2, 2, 64, BF16, CUDA)


def test_availability_on_this_torch():
    """The aten ops the paths call exist with the arguments they pass (CUDA kernels or not)."""
    assert {"cum_seq_q", "cum_seq_k", "max_q", "max_k", "scale"} <= pd._aten_args("_flash_attention_forward")
    assert {"attn_bias", "compute_log_sumexp", "scale"} <= pd._aten_args("_scaled_dot_product_cudnn_attention")
    assert pd._aten_args("no_such_op") == frozenset()


# ----------------------------------------------------------------------------- gather
@pytest.mark.parametrize("page", [16, 8])
def test_gather_paged_kv_matches_the_reference_gather(page):
    gen = torch.Generator().manual_seed(3 + page)
    lens = [37, 1, 64, 90]
    k_cache, v_cache, table = paged(lens, page, 2, 32, torch.float32, gen, extra_cols=2)
    k, v, cu_k = pd.gather_paged_kv(k_cache, v_cache, table)
    capacity = table.shape[1] * page
    assert k.shape == (len(lens) * capacity, 2, 32) and v.shape == k.shape
    assert cu_k.dtype == torch.int32 and cu_k.tolist() == [b * capacity for b in range(len(lens) + 1)]
    for b, n in enumerate(lens):
        want_k = ref._gather_context(k_cache, table[b : b + 1])[0, :n]
        want_v = ref._gather_context(v_cache, table[b : b + 1])[0, :n]
        assert torch.equal(k[b * capacity : b * capacity + n], want_k)
        assert torch.equal(v[b * capacity : b * capacity + n], want_v)


# ----------------------------------------------------------------------------- paths on CPU stand-ins
CASES = [
    # (batch, max new, max cached, Hq, Hkv, D)
    (6, 40, 70, 8, 8, 64),  # GQA ratio 1
    (5, 33, 50, 8, 2, 128),  # ratio 4
    (4, 20, 90, 7, 1, 64),  # ratio 7
]


@pytest.mark.parametrize("batch,max_new,max_ctx,hq,hkv,d", CASES)
def test_gather_path_matches_reference(monkeypatch, batch, max_new, max_ctx, hq, hkv, d):
    """Sequences with and without a cached prefix in one call: the gathered context, cu_k,
    seqused_k and the length bounds handed to flash give the reference's attention."""
    monkeypatch.setattr(pd, "flash_varlen", varlen_attention_reference)
    gen = torch.Generator().manual_seed(batch * 100 + hq)
    q_lens, ctx_lens = mixed_prefill_lens(batch, max_new, max_ctx, gen)
    args = prefill_case(q_lens, ctx_lens, hq, hkv, d, 16, gen, BF16)
    out = pd.prefill_attention(*args, d**-0.5, path="gather")
    assert out.dtype == BF16 and out.shape == args[0].shape
    assert rel_err(out, ref.prefill_attention(*fp32(args), d**-0.5)) < 1e-2


def test_cudnn_dense_views_one_sequence(monkeypatch):
    """cuDNN takes [1, H, S, D] views of contiguous tensors padded with zero rows to S, a
    multiple of 256 (a strided v is copied) and the first T rows of its [1, H, S, D]
    output come back as [T, Hq, D]; with no cached prefix that is the op."""
    monkeypatch.setattr(pd, "cudnn_sdpa", cudnn_sdpa_reference)
    gen = torch.Generator().manual_seed(5)
    q, k, _, k_cache, v_cache, cu, seq_lens, table = prefill_case([45], [45], 8, 2, 64, 16, gen, BF16)
    qkv = torch.randn(45, 12 * 64, generator=gen).to(BF16)
    v = qkv[:, 10 * 64 :].view(45, 2, 64)  # a strided view, as the model's v
    plans = []
    monkeypatch.setattr(pd, "cudnn_sdpa", lambda q, k, v, *a: plans.append((q.shape, k.shape, v.shape)) or cudnn_sdpa_reference(q, k, v, *a))
    out, lse = pd.cudnn_dense(q, k, v, 0.125)
    # padded at the end to one plan length: 45 tokens run as 256
    assert plans == [((1, 8, 256, 64), (1, 2, 256, 64), (1, 2, 256, 64))]
    assert out.shape == q.shape and out.stride(-1) == 1 and lse.shape == (1, 8, 45, 1)
    # the reference reads keys from the cache: put this v there
    ref.store_kv(k, v, k_cache, v_cache, (table[0].long()[:, None] * 16 + torch.arange(16)).view(-1)[:45])
    args = [q, k, v, k_cache, v_cache, cu, seq_lens, table]
    assert rel_err(out, ref.prefill_attention(*fp32(args), 0.125)) < 1e-2
    strides, global_rows = pd.lse_layout(lse)
    assert strides == (8 * 256, 256, 1) and not global_rows
    unpadded = cudnn_sdpa_reference(*(t.contiguous().transpose(0, 1).unsqueeze(0) for t in (q, k, v)), 0.125)[1]
    assert torch.allclose(lse, unpadded)  # the real rows' log-sum-exp, for the context kernel


def test_cudnn_dense_batch_of_equal_prompts(monkeypatch):
    """Prompts of one length, a multiple of 256, each filling its block-table row: the op
    hands cuDNN one [B, H, L, D] view of each of q/k/v (no padding, no context kernel, no
    log-sum-exp) and returns the reference's attention for every sequence."""
    from ingot.ops.triton import prefill_attention as kernels

    plans = []
    monkeypatch.setattr(pd, "cudnn_sdpa", lambda q, k, v, *a: plans.append((q.shape, k.shape, v.shape, a)) or cudnn_sdpa_reference(q, k, v, *a))
    monkeypatch.setattr(kernels, "merge_cached_context", lambda *a, **kw: pytest.fail("context kernel launched"))
    gen = torch.Generator().manual_seed(8)
    args = prefill_case([256] * 3, [256] * 3, 4, 2, 32, 16, gen, BF16, extra_cols=0)
    out = pd.prefill_attention(*args, 0.125, path="cudnn")
    assert plans == [((3, 4, 256, 32), (3, 2, 256, 32), (3, 2, 256, 32), (0.125, False))]
    assert out.shape == args[0].shape
    assert rel_err(out, ref.prefill_attention(*fp32(args), 0.125)) < 1e-2
    with pytest.raises(ValueError, match="one length, a multiple of 256"):
        pd.cudnn_dense(*args[:3], 0.125, lse=False, num_seqs=2)  # 768 tokens: two prompts of 384


def test_lse_layouts():
    assert pd.lse_layout(torch.empty(28, 100)) == ((0, 100, 1), True)  # flash varlen
    assert pd.lse_layout(torch.empty(3, 28, 64)) == ((28 * 64, 64, 1), False)  # older flash varlen
    assert pd.lse_layout(torch.empty(1, 28, 100, 1)) == ((2800, 100, 1), False)  # cuDNN


def test_flash_bounds_cover_every_sequence(monkeypatch):
    """The bounds handed to flash come from shapes: at most T and the table capacity, at
    least 2; the stand-in asserts each sequence fits them."""
    seen = {}

    def spy(q, k, v, cu_q, cu_k, max_q, max_k, scale, seqused_k=None):
        seen.update(max_q=max_q, max_k=max_k)
        return varlen_attention_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale, seqused_k)

    monkeypatch.setattr(pd, "flash_varlen", spy)
    gen = torch.Generator().manual_seed(11)
    args = prefill_case([1], [300], 4, 2, 64, 16, gen, BF16)  # one new token after 299 cached
    pd.prefill_attention(*args, 0.125, path="gather")
    assert seen == dict(max_q=2, max_k=args[7].shape[1] * 16)
    args = prefill_case([500, 3], [500, 40], 4, 2, 64, 16, gen, BF16)
    pd.prefill_attention(*args, 0.125, path="gather")
    assert seen["max_q"] == min(503, args[7].shape[1] * 16)


def test_a_window_or_softcap_takes_the_fused_kernel(everything_supported):
    """Only the fused kernel masks a sliding window and caps logits: the rule sends those
    prefills there, and asking for another path with them is an error."""
    assert pd.choose_prefill_path(4096, 1, 4096, 28, 4, 128, BF16, CUDA) == "cudnn"
    assert pd.choose_prefill_path(4096, 1, 4096, 28, 4, 128, BF16, CUDA, window=1024) == "triton"
    assert pd.choose_prefill_path(4096, 1, 4096, 28, 4, 128, BF16, CUDA, softcap=50.0) == "triton"
    args = prefill_case([3], [3], 2, 2, 16, 16, torch.Generator().manual_seed(1), BF16)
    with pytest.raises(ValueError, match="only 'triton'"):
        pd.prefill_attention(*args, 0.25, 8, 0.0, path="flash")


def test_unknown_path_raises():
    gen = torch.Generator().manual_seed(1)
    args = prefill_case([3], [3], 2, 2, 16, 16, gen, BF16)
    with pytest.raises(ValueError, match="unknown prefill path"):
        pd.prefill_attention(*args, 0.25, path="fa3")


def test_empty_batch():
    q = torch.empty(0, 4, 64, dtype=BF16)
    kv = torch.empty(0, 2, 64, dtype=BF16)
    cache = torch.zeros(2, 16, 2, 64, dtype=BF16)
    out = pd.prefill_attention(q, kv, kv, cache, cache, torch.zeros(1, dtype=torch.int32),
                               torch.empty(0, dtype=torch.int32), torch.empty(0, 1, dtype=torch.int32), 0.125)
    assert out.shape == (0, 4, 64)


def test_no_context_kernel_when_nothing_can_be_cached(monkeypatch):
    """When the new tokens fill every block-table row (B x capacity == T) no sequence has a
    cached prefix: the flash path returns flash's output without launching the context kernel."""
    from ingot.ops.triton import prefill_attention as kernels

    monkeypatch.setattr(pd, "flash_varlen", varlen_attention_reference)
    monkeypatch.setattr(kernels, "merge_cached_context", lambda *a, **kw: pytest.fail("context kernel launched"))
    gen = torch.Generator().manual_seed(21)
    args = prefill_case([32, 48], [32, 48], 4, 2, 64, 16, gen, BF16, extra_cols=0)  # capacity 48: T = 80 < 2 x 48
    with pytest.raises(pytest.fail.Exception, match="context kernel launched"):
        pd.prefill_attention(*args, 0.125, path="flash")
    args = prefill_case([48, 48], [48, 48], 4, 2, 64, 16, gen, BF16, extra_cols=0)
    out = pd.prefill_attention(*args, 0.125, path="flash")
    assert rel_err(out, ref.prefill_attention(*fp32(args), 0.125)) < 1e-2


def test_mostly_new_batches_take_flash_only_below_the_measured_length(everything_supported):
    """The measured rule: several mostly-new prompts averaging under 256 tokens run PyTorch's
    varlen flash, longer ones the fused kernel (kernels-prefill-2026-12-01.json)."""
    for tokens, seqs, want in ((32 * 128, 32, "flash"), (128 * 30, 128, "flash"), (8 * 255, 8, "flash"),
                               (8 * 272, 8, "triton"), (8 * 500, 8, "triton"), (4 * 1000, 4, "triton")):
        cap = 16 * -(-tokens // seqs // 16)  # block-table capacity of the longest prompt
        assert pd.prefill_class(tokens, seqs, cap) == (False, True)
        assert pd.choose_prefill_path(tokens, seqs, cap, 28, 4, 128, BF16, CUDA) == want
