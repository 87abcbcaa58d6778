"""The Triton kernels run on CPU through the Triton interpreter, against the references.

Opt-in (CI installs no Triton): ``INGOT_TEST_TRITON_INTERPRET=1 pytest
tests/ops/test_triton_interpret.py`` with ``triton`` installed. The module sets
``TRITON_INTERPRET=1`` and imports the kernel modules afresh, so the
``@triton.jit`` functions become interpreted ones; small shapes keep it quick.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import replace

import pytest
import torch

ENABLED = os.environ.get("INGOT_TEST_TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not ENABLED, reason="set INGOT_TEST_TRITON_INTERPRET=1 (needs triton)")

KERNEL_MODULES = (
    "softcap", "rounding", "activation", "decode_attention", "kv_store", "prefill_attention", "prefill_dispatch", "rms_norm", "rotary",
    "skinny_gemm", "quant_tiles", "quant_gemm", "int_linear", "fp8_linear", "fused_moe_quant", "mla_attention",
)


def _numpy_compat() -> None:
    """Triton 3.6's interpreter turns 1-element arrays into ints with int(array),
    which NumPy >= 2.4 refuses; use .item() instead (test-only patch)."""
    from triton.runtime import interpreter as interp

    scope = getattr(interp, "_LangPatchScope", None)
    if scope is None or getattr(scope.set_attr, "_ingot_compat", False):
        return
    original = scope.set_attr

    def set_attr(self, obj, name, value):
        if name == "__index__":
            value = lambda t: int(t.handle.data.item())  # noqa: E731
        return original(self, obj, name, value)

    set_attr._ingot_compat = True
    scope.set_attr = set_attr


class PoisonTorch:
    """``torch`` for the kernel modules, whose new tensors come pre-filled with
    NaN (floats) or junk (ints), so an element a kernel fails to write fails."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan") if t.is_floating_point() else -77)

    def empty(self, *args, **kwargs):
        return self._poison(torch.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs):
        return self._poison(torch.empty_like(*args, **kwargs))


if ENABLED and "triton" not in sys.modules:
    # must precede the first import of triton: its own @jit helpers (tl.cdiv, ...)
    # become interpreted functions only if the variable is set by then
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="module")
def K():
    """The kernel modules, imported afresh under TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    if os.environ.get("TRITON_INTERPRET") != "1" or not isinstance(standard.cdiv, InterpretedFunction):
        pytest.skip("triton was imported before interpreter mode was set: run this file in its own pytest process")
    _numpy_compat()
    mods = {}
    for name in KERNEL_MODULES:
        full = f"ingot.ops.triton.{name}"
        mod = sys.modules.get(full)
        mods[name] = importlib.reload(mod) if mod is not None else importlib.import_module(full)
    saved_torch = {name: mod.torch for name, mod in mods.items() if hasattr(mod, "torch")}
    for name in saved_torch:
        mods[name].torch = PoisonTorch()  # outputs and scratch start as NaN / junk
    yield type("Kernels", (), mods)
    for name, saved in saved_torch.items():
        mods[name].torch = saved
    import ingot.ops.triton as package

    for name in KERNEL_MODULES:  # interpreted kernels must not leak into other modules
        sys.modules.pop(f"ingot.ops.triton.{name}", None)
        package.__dict__.pop(name, None)


from ingot.ops import reference as ref  # noqa: E402
from tests.ops.kernel_cases import (  # noqa: E402
    check_linear_norm_router, check_prologue_linear, check_rope_decode, check_store_kv, cudnn_sdpa_reference,
    mixed_prefill_lens, prefill_case, rel_err, rope_decode_case, rope_table, varlen_attention_reference,
)
from tests.ops.kernel_cases import paged as _paged  # noqa: E402


def paged(lens, page, hkv, d, dtype, gen, extra_cols=1):
    return _paged(lens, page, hkv, d, dtype, gen, extra_cols)






DECODE_CASES = [
    # (Hq, Hkv, D, page, lens, splits)
    (4, 4, 64, 16, [1, 37], None),
    (8, 2, 64, 16, [100, 1, 17], 3),
    (7, 1, 128, 16, [130, 65], 4),
    (8, 1, 64, 16, [16, 32, 33], 64),  # more splits than tiles: empty slices
    (16, 2, 32, 128, [300], None),  # page larger than the tile
    (4, 2, 64, 8, [1, 1, 1, 1], 1),  # padding rows only, direct write
    (6, 2, 48, 16, [50, 3], 2),  # head dim not a power of two
]


@pytest.mark.parametrize("hq,hkv,d,page,lens,splits", DECODE_CASES)
def test_decode_attention(K, hq, hkv, d, page, lens, splits):
    gen = torch.Generator().manual_seed(hash((hq, hkv, d, page, len(lens))) & 0xFFFF)
    k_cache, v_cache, table = paged(lens, page, hkv, d, torch.bfloat16, gen)
    q = torch.randn(len(lens), hq, d, generator=gen).to(torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = d**-0.5
    out = K.decode_attention.decode_attention(q, k_cache, v_cache, table, seq_lens, scale, num_splits=splits)
    expected = ref.decode_attention(q.float(), k_cache.float(), v_cache.float(), table, seq_lens, scale)
    assert out.dtype == q.dtype
    assert rel_err(out, expected) < 1e-2


ROPE_DECODE_CASES = [
    # (Hq, Hkv, D, page, lens, splits)
    (4, 2, 64, 16, [37, 1], None),
    (8, 2, 64, 16, [100, 17, 16, 1], 3),  # new token first of its tile / block
    (7, 1, 128, 16, [130, 65, 1], 4),
    (4, 4, 32, 8, [64, 65, 1], 64),  # more splits than tiles
    (8, 2, 64, 16, [129, 1], 1),  # direct write
]


@pytest.mark.parametrize("hq,hkv,d,page,lens,splits", ROPE_DECODE_CASES)
def test_decode_attention_rope(K, hq, hkv, d, page, lens, splits):
    gen = torch.Generator().manual_seed(hash((hq, d, page, len(lens))) & 0xFFFF)
    args = rope_decode_case(lens, hq, hkv, d, page, torch.bfloat16, gen)
    check_rope_decode(lambda *a: K.decode_attention.decode_attention_rope(*a, num_splits=splits), args)


@pytest.mark.parametrize("hq,hkv,d,page,lens,splits", [ROPE_DECODE_CASES[1], ROPE_DECODE_CASES[2], ROPE_DECODE_CASES[4]])
def test_decode_attention_rope_with_head_norms(K, hq, hkv, d, page, lens, splits):
    """Qwen3's per-head q/k RMSNorm folded into the fused decode kernel, against the reference
    ops in sequence (norm, rotary, store, attention)."""
    gen = torch.Generator().manual_seed(hash((hq, d, page, len(lens), "norm")) & 0xFFFF)
    args = rope_decode_case(lens, hq, hkv, d, page, torch.bfloat16, gen, qk_norm=True)
    check_rope_decode(lambda *a: K.decode_attention.decode_attention_rope(*a, num_splits=splits), args)


def test_decode_attention_rope_needs_both_head_norms(K):
    gen = torch.Generator().manual_seed(2)
    args = rope_decode_case([9, 1], 4, 2, 32, 16, torch.bfloat16, gen, qk_norm=True)
    with pytest.raises(ValueError, match="both weights or neither"):
        K.decode_attention.decode_attention_rope(*args[:11], args[11], None, args[13])


def test_decode_merge_kernel_fallback(K):
    """The separate merge kernel (used when the split counters are unavailable) agrees."""
    gen = torch.Generator().manual_seed(8)
    args = rope_decode_case([90, 33, 1], 8, 2, 64, 16, torch.bfloat16, gen)
    cfg = replace(K.decode_attention.launch_config(64, 3 * 2, torch.device("cpu")), merge_kernel=True)
    check_rope_decode(lambda *a: K.decode_attention.decode_attention_rope(*a, num_splits=4, config=cfg), args)


def skinny_config(K, m, n, k, prologue=0, router=False, **fields):
    """The default launch configuration with small K tiles (so short rows still split) and ``fields``."""
    return replace(K.skinny_gemm.launch_config(m, n, k, torch.device("cpu"), prologue, router), block_k=32, **fields)


@pytest.mark.parametrize("m,n,k,bias,splits", [(1, 100, 96, True, None), (1, 100, 96, True, 2),
                                              (3, 64, 300, False, 3), (16, 130, 256, True, 2),
                                              (5, 17, 40, False, 1)])
def test_skinny_linear(K, m, n, k, bias, splits):
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    out = K.skinny_gemm.skinny_linear(x, w, b, skinny_config(K, m, n, k, splits=splits))
    expected = ref.skinny_linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert rel_err(out, expected) < 1e-2
    from ingot.ops.triton._common import _counters

    assert all(int(c.count_nonzero()) == 0 for c in _counters.values())  # left at zero


@pytest.mark.parametrize("prologue", ["norm", "norm_scaled", "silu"])
@pytest.mark.parametrize("m,n,k,bias,splits", [(1, 40, 96, True, None), (1, 24, 300, False, 3), (3, 33, 64, True, 2)])
def test_prologue_linear(K, prologue, m, n, k, bias, splits):
    """RMSNorm (also handing on its input in two factors) / SiLU-and-mul fused in front of the
    skinny GEMM, one row (multiply-reduce) and a few (tl.dot), whole-K programs and split K; a
    narrower prologue tile for the first case."""
    code = K.skinny_gemm.SILU if prologue == "silu" else K.skinny_gemm.NORM
    narrow = {"block_n": 16} if splits is None else {}
    cfg = skinny_config(K, m, n, k, code, splits=splits, **narrow)
    check_prologue_linear(K.skinny_gemm, prologue, m, n, k, bias, torch.Generator().manual_seed(m + n + k), config=cfg)


@pytest.mark.parametrize("m,n,k,experts,bias,fields", [
    (1, 64, 96, 8, False, {}), (1, 40, 300, 24, True, {"splits": 3}), (1, 48, 64, 128, False, {"splits": 1}),
    (1, 33, 200, 5, False, {"splits": 2, "block_n": 8}), (3, 40, 64, 6, True, {}), (3, 40, 300, 6, False, {"splits": 3}),
    (1, 88, 96, 6, False, {"block_n": 8, "share_block": 32}),  # 11 tiles' shares in rounds of 4, the last one short
    (1, 48, 320, 12, False, {"num_warps": 2, "waves": 8}),
])
def test_linear_norm_router(K, m, n, k, experts, bias, fields):
    """A projection joining the residual stream, then a MoE layer's norm and router, in one
    launch (one row: split K and whole-K tiles, a tile count the last tile's loop does not
    divide) and as two launches (more rows); the counters are left at zero."""
    cfg = skinny_config(K, m, n, k, router=True, **fields)
    check_linear_norm_router(K.skinny_gemm, m, n, k, experts, bias, torch.Generator().manual_seed(n + k), config=cfg)
    from ingot.ops.triton._common import _counters

    assert all(int(c.count_nonzero()) == 0 for c in _counters.values())


def test_decode_zero_length_is_finite(K):
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache, table = paged([5, 3], 16, 2, 64, torch.bfloat16, gen)
    q = torch.randn(2, 4, 64, generator=gen).to(torch.bfloat16)
    for splits in (1, 3):
        out = K.decode_attention.decode_attention(
            q, k_cache, v_cache, table, torch.tensor([0, 3], dtype=torch.int32), 0.125, num_splits=splits
        )
        assert torch.isfinite(out.float()).all()
        assert (out[0] == 0).all()


def test_choose_num_splits(K):
    cpu = torch.device("cpu")
    f = K.decode_attention.choose_num_splits
    assert f(256, 8, 256, 16, 64, cpu) == 1  # plenty of programs already
    assert f(1, 2, 256, 16, 64, cpu) == K.decode_attention.MAX_SPLITS
    assert f(1, 2, 2, 16, 64, cpu) == 1  # a 32-token table is a single tile
    assert 1 < f(64, 2, 128, 16, 64, cpu) <= 8


# ----------------------------------------------------------------------------- sliding window, soft-cap
from tests.ops.window_cases import decode_window_case, prefill_window_case  # noqa: E402


def _poison_outside_window(cache_pair, table, first_queries, window, page):
    """NaN into every block wholly before each row's window: a kernel that reads one fails."""
    for b, first in enumerate(first_queries):
        for i in range(max(0, first - window + 1) // page):
            for cache in cache_pair:
                cache[int(table[b, i])] = float("nan")


@pytest.mark.parametrize("lens,page,window,softcap,splits", [
    ([1, 40, 70], 16, 24, 0.0, 3),  # the window starts mid-tile; slices over the window only
    ([70, 9], 8, 8, 0.0, None),
    ([50, 33], 16, 17, 2.0, 2),
    ([64, 20], 16, 0, 3.0, 1),  # soft-cap alone, direct write
])
def test_decode_attention_window(K, lens, page, window, softcap, splits):
    gen = torch.Generator().manual_seed(sum(lens) + window)
    args, expected = decode_window_case(lens, 4, 2, 32, page, gen)
    if window:
        _poison_outside_window(args[1:3], args[3], [n - 1 for n in lens], window, page)
    out = K.decode_attention.decode_attention(*args, 0.2, window, softcap, num_splits=splits)
    assert rel_err(out, expected(window, 0.2, softcap)) < 1e-4


def test_decode_attention_rope_window(K):
    gen = torch.Generator().manual_seed(21)
    args = rope_decode_case([70, 33, 1], 4, 2, 32, 16, torch.bfloat16, gen)
    check_rope_decode(lambda *a: K.decode_attention.decode_attention_rope(*a, num_splits=3), [*args, None, None, 0.0, 20, 5.0])


def test_choose_num_splits_within_a_window(K):
    f = K.decode_attention.choose_num_splits
    assert f(1, 2, 256, 16, 64, torch.device("cpu"), window=100) == 3  # the tiles 100 tokens can touch


@pytest.mark.parametrize("q_lens,totals,page,window,softcap", [
    ([5, 1, 12, 9], [21, 14, 12, 30], 4, 6, 0.0),  # chunks straddling the window's edge
    ([40, 20], [100, 20], 8, 24, 0.0),  # the window skips cached and new-token tiles
    ([33, 7], [80, 50], 8, 10, 1.5),
    ([30], [30], 8, 0, 2.0),  # soft-cap alone
])
def test_prefill_attention_window(K, q_lens, totals, page, window, softcap):
    gen = torch.Generator().manual_seed(sum(totals) + window)
    args, expected = prefill_window_case(q_lens, totals, 4, 2, 32, page, gen)
    if window:
        _poison_outside_window(args[3:5], args[7], [n - m for m, n in zip(q_lens, totals)], window, page)
    cfg = K.prefill_attention.PrefillConfig(16, 16, 4, 2)  # several query and key tiles per sequence
    out = K.prefill_attention.prefill_attention(*args, 0.2, window, softcap, config=cfg)
    assert rel_err(out, expected(window, 0.2, softcap)) < 1e-4
    out = K.prefill_dispatch.prefill_attention(*args, 0.2, window, softcap, config=cfg)  # the dispatch: this kernel
    assert rel_err(out, expected(window, 0.2, softcap)) < 1e-4


@pytest.mark.parametrize("window,softcap,sinks,splits", [
    (0, 0.0, False, None),
    (0, 0.0, False, 3),  # several slices: the rows of one sequence in different programs
    (6, 2.0, False, 2),  # each row's window starts one position later than the row before it
    (0, 0.0, True, 1),
])
def test_decode_attention_of_verify_rows(K, window, softcap, sinks, splits):
    """Speculative decoding's verify rows: sequence b's last ``q_lens[b]`` tokens as one decode
    row each (its block table repeated, ``seq_len = position + 1``) plus a padding row, their
    K/V stored first by the store_kv kernel into NaN slots: each row's decode attention equals
    dense causal attention at its position (the kernel reads the repeated table only)."""
    gen = torch.Generator().manual_seed(window + splits if splits else 31)
    q_lens, totals, page = [4, 1, 3], [21, 9, 3], 4
    (q, k, v, k_cache, v_cache, _, _, table), expected = prefill_window_case(q_lens, totals, 4, 2, 32, page, gen)
    rows = [(b, pos) for b, (m, n) in enumerate(zip(q_lens, totals)) for pos in range(n - m, n)]
    slots = torch.tensor([int(table[b, pos // page]) * page + pos % page for b, pos in rows] + [0])
    k_cache.view(-1, 2, 32)[slots[:-1]] = float("nan")  # read before the store: NaN in the output
    v_cache.view(-1, 2, 32)[slots[:-1]] = float("nan")
    pad = [torch.randn(1, *x.shape[1:], generator=gen) for x in (q, k, v)]
    q, k, v = (torch.cat([x, p]) for x, p in zip((q, k, v), pad))
    tables = torch.cat([table[[b for b, _ in rows]], torch.zeros(1, table.shape[1], dtype=torch.int32)])
    seq_lens = torch.tensor([pos + 1 for _, pos in rows] + [1], dtype=torch.int32)
    sink = torch.randn(4, generator=gen) if sinks else None
    K.kv_store.store_kv(k, v, k_cache, v_cache, slots)
    out = K.decode_attention.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.2, window, softcap, sink,
                                              num_splits=splits)
    assert rel_err(out[:-1], expected(window, 0.2, softcap, sink)) < 1e-4


def test_store_kv(K):
    check_store_kv(K.kv_store.store_kv, t=9, hkv=2, d=64, page=16, nb=6, gen=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(5, 96), (3, 4, 32), (1, 200)])
def test_rms_norm(K, dtype, shape):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    out = K.rms_norm.rms_norm(x, w, 1e-6)
    expected = ref.rms_norm(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, expected) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_rms_norm_strided_heads(K):
    """The per-head q/k norm of Qwen3: [T, H, D] views into a fused qkv output."""
    gen = torch.Generator().manual_seed(4)
    t, h, d = 5, 3, 32
    qkv = torch.randn(t, (h + 2) * d, generator=gen).to(torch.bfloat16)
    q = qkv[:, : h * d].reshape(t, h, d)
    w = torch.randn(d, generator=gen).to(torch.bfloat16)
    out = K.rms_norm.rms_norm(q, w, 1e-6)
    expected = ref.rms_norm(q, w, 1e-6)
    assert rel_err(out, expected) < 1e-2


@pytest.mark.parametrize("fields", [{}, {"block_r": 1, "num_warps": 2, "weight_first": True},
                                    {"block_r": 4, "num_warps": 4, "weight_first": False}])
def test_add_rms_norm(K, fields):
    """The default configuration (all 6 rows in one program), one row per program, and
    a last program with rows past the end."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 160, generator=gen).to(torch.bfloat16)
    r = torch.randn(6, 160, generator=gen).to(torch.bfloat16)
    w = torch.randn(160, generator=gen).to(torch.bfloat16)
    cfg = replace(K.rms_norm.launch_config(6, 160), **fields)
    out, res = K.rms_norm.add_rms_norm(x, r, w, 1e-5, cfg)
    exp_out, exp_res = ref.add_rms_norm(x, r, w, 1e-5)
    # the interpreter truncates fp32 -> bf16 (GPUs round to nearest), so no
    # bit-exactness here: tests/ops/test_triton_kernels.py checks that on the GPU
    assert rel_err(res, exp_res) < 1e-2
    assert rel_err(out, exp_out) < 1e-2


@pytest.mark.parametrize("shape", [(7, 2 * 200), (2, 3, 2 * 64), (1, 2 * 1500)])
def test_silu_and_mul(K, shape):
    gen = torch.Generator().manual_seed(6)
    x = (2 * torch.randn(*shape, generator=gen)).to(torch.bfloat16)
    out = K.activation.silu_and_mul(x)
    expected = ref.silu_and_mul(x)
    assert out.shape == expected.shape
    assert rel_err(out, expected) < 1e-2


@pytest.mark.parametrize("t,hq,hkv,d", [
    (6, 4, 2, 64), (6, 7, 1, 128), (6, 2, 2, 32),
    (1, 12, 2, 64),  # decode
    (37, 9, 3, 128),  # odd head counts, tokens not a tile multiple
    (19, 28, 4, 128),  # the benchmark's heads
    (3, 40, 8, 128),  # q's heads split over two tiles
    (5, 3, 1, 48),  # half head dim not a power of two
])
def test_rotary(K, t, hq, hkv, d):
    gen = torch.Generator().manual_seed(7 + t + hq + d)
    max_pos = 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(torch.bfloat16)
    q = qkv[:, : hq * d].reshape(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d)
    cache = rope_table(max_pos, d, 10000.0)
    positions = torch.randint(0, max_pos, (t,), generator=gen)
    q_exp, k_exp = ref.rotary_embedding(positions, q, k, cache)
    # the default tiles, and small ones (several tiles per tensor, heads split across them)
    for cfg in (None, K.rotary.RotaryConfig(tile_pairs=64, num_warps=2)):
        q_out, k_out = K.rotary.rotary_embedding(positions, q, k, cache, cfg)
        assert rel_err(q_out, q_exp) < 1e-2 and rel_err(k_out, k_exp) < 1e-2
        # bf16 rounding is done with integer ops, so even the interpreter (which truncates
        # its own fp32 -> bf16 casts) must match eager bit for bit
        assert torch.equal(q_out, q_exp) and torch.equal(k_out, k_exp)


def _prefill_case(q_lens, ctx_lens, hq, hkv, d, page, gen, dtype=torch.bfloat16):
    """Packed new tokens whose k/v are already stored; returns the op's arguments."""
    return prefill_case(q_lens, ctx_lens, hq, hkv, d, page, gen, dtype)


PREFILL_CASES = [
    # (q_lens, ctx_lens, Hq, Hkv, D, page)
    ([5], [5], 2, 2, 64, 16),
    ([130, 3, 17], [130, 3, 17], 4, 1, 64, 16),  # crosses a 128-row tile
    ([20, 9], [70, 40], 4, 2, 32, 16),  # chunked prefill: cached prefixes
    ([1, 33], [200, 33], 7, 1, 64, 8),  # a single new token after a long prefix
    ([40], [300], 2, 2, 48, 64),  # head dim not a power of two, big pages
]


@pytest.mark.parametrize("q_lens,ctx_lens,hq,hkv,d,page", PREFILL_CASES)
def test_prefill_attention(K, q_lens, ctx_lens, hq, hkv, d, page):
    gen = torch.Generator().manual_seed(8 + sum(q_lens))
    args = _prefill_case(q_lens, ctx_lens, hq, hkv, d, page, gen)
    scale = d**-0.5
    out = K.prefill_attention.prefill_attention(*args, scale)
    f = [a.float() if a.is_floating_point() else a for a in args]
    expected = ref.prefill_attention(*f, scale)
    assert out.dtype == args[0].dtype
    assert rel_err(out, expected) < 1e-2


def test_prefill_attention_square_tiles(K):
    """128 x 128 tiles (the H200's configuration at head dim 128): the diagonal tile is one key
    tile, and query tiles that end mid-tile."""
    gen = torch.Generator().manual_seed(12)
    args = _prefill_case([150, 20], [170, 20], 2, 1, 32, 16, gen)
    cfg = K.prefill_attention.PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
    out = K.prefill_attention.prefill_attention(*args, 32**-0.5, config=cfg)
    expected = ref.prefill_attention(*[a.float() if a.is_floating_point() else a for a in args], 32**-0.5)
    assert rel_err(out, expected) < 1e-2


def test_prefill_attention_wide_context_tiles(K):
    """Key tiles over the cached prefix wider and narrower than over the new tokens: full
    prefix tiles, a masked tail, and prefixes shorter than one tile."""
    gen = torch.Generator().manual_seed(13)
    args = _prefill_case([20, 9, 70, 1], [150, 40, 70, 17], 4, 2, 32, 16, gen)
    expected = ref.prefill_attention(*[a.float() if a.is_floating_point() else a for a in args], 32**-0.5)
    for cfg in (K.prefill_attention.PrefillConfig(64, 32, 4, 2, block_n_ctx=128),
                K.prefill_attention.PrefillConfig(64, 64, 4, 2, block_n_ctx=16, ctx_stages=5)):
        out = K.prefill_attention.prefill_attention(*args, 32**-0.5, config=cfg)
        assert rel_err(out, expected) < 1e-2, cfg


# (batch, max new, max cached, Hq, Hkv, D)
PATH_CASES = [
    (5, 40, 70, 4, 4, 64),  # GQA ratio 1
    (4, 33, 50, 8, 2, 32),  # ratio 4
    (4, 20, 90, 7, 1, 48),  # ratio 7, head dim not a power of two
]


@pytest.mark.parametrize("path", ["flash", "gather"])
@pytest.mark.parametrize("batch,max_new,max_ctx,hq,hkv,d", PATH_CASES)
def test_prefill_paths(K, monkeypatch, path, batch, max_new, max_ctx, hq, hkv, d):
    """Each path of the prefill dispatch, PyTorch's flash kernel replaced by a CPU stand-in
    of its contract: sequences with and without a cached prefix in one call; the flash
    path's context kernel folds the prefixes into flash's output (in the interpreter)."""
    monkeypatch.setattr(K.prefill_dispatch, "flash_varlen", varlen_attention_reference)
    gen = torch.Generator().manual_seed(batch * 10 + hq + d)
    q_lens, ctx_lens = mixed_prefill_lens(batch, max_new, max_ctx, gen)
    args = prefill_case(q_lens, ctx_lens, hq, hkv, d, 16, gen)
    out = K.prefill_dispatch.prefill_attention(*args, d**-0.5, path=path)
    expected = ref.prefill_attention(*[a.float() if a.is_floating_point() else a for a in args], d**-0.5)
    assert out.dtype == args[0].dtype
    assert rel_err(out, expected) < 1e-2


@pytest.mark.parametrize("sms", [1, 7])
def test_context_kernel_programs_take_several_tiles(K, monkeypatch, sms):
    """A batch of mostly new tokens gets one wave of context programs, each taking every
    ``groups``-th query tile of its sequence (16-row tiles here: several per program)."""
    monkeypatch.setattr(K.prefill_dispatch, "flash_varlen", varlen_attention_reference)
    monkeypatch.setattr(K.prefill_attention, "num_sms", lambda device: sms)
    gen = torch.Generator().manual_seed(40 + sms)
    # capacity 80 tokens: 2 x 153 new >= 3 x 80, "mostly new"; two sequences with a short prefix
    args = prefill_case([70, 50, 33], [74, 50, 40], 2, 1, 32, 16, gen, extra_cols=0)
    cfg = K.prefill_attention.PrefillConfig(16, 16, 4, 2)
    groups = K.prefill_attention.context_tile_groups(80, 3, 2, 16, 1, args[0].device)
    assert groups == (1 if sms == 1 else 2) and K.prefill_attention.context_tile_groups(80, 3, 2, 16, None, args[0].device) == 5
    expected = ref.prefill_attention(*[a.float() if a.is_floating_point() else a for a in args], 32**-0.5)
    out = K.prefill_dispatch.prefill_attention(*args, 32**-0.5, path="flash", config=cfg)
    assert rel_err(out, expected) < 1e-2


def test_context_kernel_reads_padded_lse(K, monkeypatch):
    """Older flash returns the log-sum-exp padded per sequence ([B, Hq, max_q]): rows within
    the sequence, not packed rows."""
    def padded(*a, **kw):
        return varlen_attention_reference(*a, **kw, padded_lse=True)

    monkeypatch.setattr(K.prefill_dispatch, "flash_varlen", padded)
    gen = torch.Generator().manual_seed(31)
    args = prefill_case([30, 5, 17], [90, 5, 60], 4, 2, 32, 16, gen)
    out = K.prefill_dispatch.prefill_attention(*args, 32**-0.5, path="flash")
    expected = ref.prefill_attention(*[a.float() if a.is_floating_point() else a for a in args], 32**-0.5)
    assert rel_err(out, expected) < 1e-2


@pytest.mark.parametrize("q_len,ctx_len,extra_cols", [(50, 50, 1), (40, 170, 1), (2, 33, 1), (48, 48, 0)])
def test_prefill_cudnn_path(K, monkeypatch, q_len, ctx_len, extra_cols):
    """One sequence: PyTorch's cuDNN attention (a CPU stand-in here) over the new tokens,
    then the context kernel over the cached prefix, if any (none can be cached when the new
    tokens fill the block-table row: then no log-sum-exp is asked for)."""
    monkeypatch.setattr(K.prefill_dispatch, "cudnn_sdpa", cudnn_sdpa_reference)
    gen = torch.Generator().manual_seed(q_len + ctx_len)
    args = prefill_case([q_len], [ctx_len], 8, 2, 32, 16, gen, extra_cols=extra_cols)
    out = K.prefill_dispatch.prefill_attention(*args, 32**-0.5, path="cudnn")
    expected = ref.prefill_attention(*[a.float() if a.is_floating_point() else a for a in args], 32**-0.5)
    assert rel_err(out, expected) < 1e-2


def test_launch_configs_are_the_measured_defaults(K):
    """The tables each kernel launches with when no configuration is passed (docs/benchmarks.md)."""
    cpu = torch.device("cpu")  # 132 SMs assumed off-GPU, as on the H200
    da, sg, rn, pa = K.decode_attention, K.skinny_gemm, K.rms_norm, K.prefill_attention
    assert da.launch_config(128, 64 * 2, cpu) == da.DecodeConfig(128, 4, 3, waves=1)  # batch 64
    assert da.launch_config(128, 2, cpu) == da.DecodeConfig(64, 8, 2, waves=2)  # batch 1
    assert da.launch_config(256, 2, cpu) == da.DecodeConfig(64, 4, 3, waves=2)
    assert sg.launch_config(1, 2048, 1536, cpu) == sg.SkinnyConfig(False, 16, 256, 4, 4, waves=4)
    assert sg.launch_config(1, 2048, 1536, cpu, sg.NORM).block_n == 32
    assert sg.launch_config(1, 1536, 8960, cpu, sg.SILU).block_n == 32
    assert sg.launch_config(8, 2048, 1536, cpu) == sg.SkinnyConfig(True, 64, 64, 4, 4, waves=2)
    assert rn.launch_config(4096, 3584) == rn.RmsNormConfig(block_r=1, num_warps=8, weight_first=False)
    assert rn.launch_config(1, 1536) == rn.RmsNormConfig(block_r=1, num_warps=4, weight_first=True)
    assert rn.launch_config(300, 128) == rn.RmsNormConfig(block_r=32, num_warps=8, weight_first=False)
    assert K.rotary.launch_config() == K.rotary.RotaryConfig(tile_pairs=2048, num_warps=4)
    assert pa.launch_config(128, cpu) == pa.PrefillConfig(128, 64, 8, 3)  # sm90 takes 128-wide key tiles
    assert pa.launch_config(64, cpu) == pa.PrefillConfig(128, 64, 4, 3)
    assert pa.launch_config(256, cpu) == pa.PrefillConfig(64, 32, 4, 2)
    assert pa.context_launch_config(128, cpu) == pa.PrefillConfig(128, 64, 8, 3)


def test_kernels_take_their_ops_arguments(K, MOE):
    """Each kernel marked ``@cuda_kernel`` implements an op and accepts its arguments in the op's
    order (extra ones are optional); every op has one."""
    import inspect

    from ingot.ops import library
    from ingot.ops.triton._common import CUDA_KERNELS

    assert set(CUDA_KERNELS) == set(library.OPS)
    for name, fn in CUDA_KERNELS.items():
        op_params = [a.name for a in getattr(torch.ops.ingot, name).default._schema.arguments]
        params = list(inspect.signature(fn).parameters.values())
        assert [p.name for p in params[: len(op_params)]] == op_params, name
        assert all(p.default is not inspect.Parameter.empty for p in params[len(op_params):]), name


def test_outputs_are_poisoned(K):
    """The harness itself: new tensors in the kernel modules start as NaN."""
    assert torch.isnan(K.rms_norm.torch.empty(3)).all()
    assert torch.isnan(K.decode_attention.torch.empty_like(torch.zeros(2))).all()


# ----------------------------------------------------------------------------- fused_moe
# Its own fixture (the module imported afresh and poisoned like the others), so the cases
# below stand apart from the kernel list above.
from tests.ops.moe_cases import ROUTINGS, check_fused_moe, expected_alignment, moe_inputs  # noqa: E402


@pytest.fixture(scope="module")
def MOE(K):
    import importlib

    name = "ingot.ops.triton.fused_moe"
    mod = importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
    saved, mod.torch = mod.torch, PoisonTorch()
    yield mod
    mod.torch = saved
    sys.modules.pop(name, None)
    import ingot.ops.triton as package

    package.__dict__.pop("fused_moe", None)


MOE_CASES = [
    # (tokens, experts, top_k, hidden, inter)
    (1, 8, 2, 64, 32),
    (5, 8, 3, 48, 40),  # widths not multiples of the tiles
    (20, 4, 2, 32, 16),
    (9, 16, 4, 64, 32),
    (3, 6, 1, 32, 24),
]


@pytest.mark.parametrize("grouped", [False, True], ids=["per_pair", "grouped"])
@pytest.mark.parametrize("t,e,k,h,i", MOE_CASES)
def test_fused_moe(MOE, grouped, t, e, k, h, i):
    launch = MOE.MoeLaunch(True, 16, (16, 16, 4, 1), (16, 32, 4, 1)) if grouped else MOE.MoeLaunch(False, 1, (16, 32, 4, 1), (16, 16, 4, 1))
    args = moe_inputs(t, e, k, h, i, torch.float32, torch.Generator().manual_seed(t * 31 + e), routing="random")
    check_fused_moe(lambda *a: MOE.run(*a, launch=launch), args, tol=1e-5)
    scale = torch.rand(t, generator=torch.Generator().manual_seed(t)) + 0.5  # each token's gate/up sums scaled
    check_fused_moe(lambda *a: MOE.run(*a, launch=launch), args + [scale], tol=1e-5)
    from ingot.ops.triton._common import _counters

    assert all(int(c.count_nonzero()) == 0 for c in _counters.values())  # the per-pair sum's counters left at zero


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("grouped", [False, True], ids=["per_pair", "grouped"])
def test_fused_moe_routings_bf16(MOE, routing, grouped):
    """Every token on one expert (one expert's blocks hold all pairs), evenly spread routing,
    and fp32 routing weights (Mixtral) on bf16 activations."""
    launch = MOE.MoeLaunch(True, 16, (16, 16, 4, 1), (16, 16, 4, 1)) if grouped else MOE.PER_PAIR
    gen = torch.Generator().manual_seed(11)
    args = moe_inputs(18, 8, 2, 64, 32, torch.bfloat16, gen, routing=routing, fp32_weights=routing == "even")
    check_fused_moe(lambda *a: MOE.run(*a, launch=launch), args, tol=1e-2)
    if not grouped:  # the batch-1 launches of Qwen3-30B-A3B (8-row gate/up tiles) and Mixtral (8 x 512 down tiles)
        check_fused_moe(lambda *a: MOE.run(*a, launch=MOE.PER_PAIR_NARROW), args, tol=1e-2)
        check_fused_moe(lambda *a: MOE.run(*a, launch=MOE.PER_PAIR_LONG_K), args, tol=1e-2)


def test_fused_moe_table_path(MOE):
    """Without a launch the table decides (per pair at one token, grouped at many), both correct."""
    for t in (1, 40):
        args = moe_inputs(t, 128, 8, 32, 768 // 24, torch.float32, torch.Generator().manual_seed(t), routing="random")
        check_fused_moe(MOE.fused_moe, args, tol=1e-5)
    assert MOE.launch_config(128, 768, 1, torch.device("cpu")) == MOE.PER_PAIR_NARROW  # the H200 sweep's batch-1 choice
    assert MOE.launch_config(128, 768, 2, torch.device("cpu")) == MOE.PER_PAIR
    assert MOE.launch_config(128, 768, 16, torch.device("cpu")).grouped
    assert MOE.launch_config(8, 14336, 1, torch.device("cpu")) == MOE.PER_PAIR_LONG_K
    assert MOE.launch_config(8, 14336, 2, torch.device("cpu")).grouped


@pytest.mark.parametrize("t,e,k,bm", [(7, 5, 2, 16), (40, 3, 3, 16), (1, 8, 2, 16), (33, 64, 4, 32)])
def test_fused_moe_alignment(MOE, t, e, k, bm):
    """Each expert's pairs in pair order, padded with P to a multiple of the block, at its offset;
    each block's expert; blocks past the routing's last marked -1 (every entry written)."""
    ids = moe_inputs(t, e, k, 8, 8, torch.float32, torch.Generator().manual_seed(t + e), routing="random")[4]
    flat = ids.contiguous().view(-1)
    pairs = flat.numel()
    blocks = -(-(pairs + min(e, pairs) * (bm - 1)) // bm)
    sorted_ids = MOE.torch.empty(blocks * bm, dtype=torch.int32)
    block_expert = MOE.torch.empty(blocks, dtype=torch.int32)
    MOE._align_kernel[(e,)](flat, sorted_ids, block_expert, pairs, blocks, BLOCK_M=bm, CHUNK=16,
                            E_BINS=max(2, 1 << (e - 1).bit_length()), BLOCK_B=max(2, 1 << (-(-pairs // bm) - 1).bit_length()))
    want_sorted, want_blocks = expected_alignment(flat.tolist(), e, bm)
    used = len(want_blocks)
    assert sorted_ids[: used * bm].tolist() == want_sorted
    assert block_expert.tolist() == want_blocks + [-1] * (blocks - used)
