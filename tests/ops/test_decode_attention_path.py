"""Decode runs rotary + KV store + attention as the one fused op, unless compile keeps rotary native."""

from __future__ import annotations

import types

import torch

import ingot.layers.attention as attention_mod
from ingot.layers.attention import Attention, AttentionMetadata
from ingot.layers.rotary import RotaryEmbedding
from ingot.layers.policy import OpPolicy
from ingot.ops import reference as ref


class OpSpy:
    """``torch.ops.ingot`` that records which ops a layer calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        op = getattr(torch.ops.ingot, name)

        def call(*args, **kwargs):
            self.calls.append(name)
            return op(*args, **kwargs)

        return call


def _layer_and_inputs():
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, page = 4, 2, 16, 4
    layer = Attention(hq, hkv, d, d**-0.5)
    layer.k_cache = torch.randn(6, page, hkv, d, generator=gen)
    layer.v_cache = torch.randn(6, page, hkv, d, generator=gen)
    rotary = RotaryEmbedding(d, 64, 10000.0)
    lens = torch.tensor([7, 3], dtype=torch.int32)
    tables = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    positions = lens.long() - 1
    slots = torch.stack([tables[i, int(p) // page].long() * page + int(p) % page for i, p in enumerate(positions)])
    meta = AttentionMetadata(False, slots, tables, lens)
    q = torch.randn(2, hq, d, generator=gen)
    k = torch.randn(2, hkv, d, generator=gen)
    v = torch.randn(2, hkv, d, generator=gen)
    return layer, rotary, positions, q, k, v, meta


def test_decode_uses_fused_op_and_native_rotary_splits_it(monkeypatch):
    spy = OpSpy()
    monkeypatch.setattr(attention_mod, "torch", types.SimpleNamespace(ops=types.SimpleNamespace(ingot=spy)))
    layer, rotary, positions, q, k, v, meta = _layer_and_inputs()
    caches = (layer.k_cache.clone(), layer.v_cache.clone())

    fused = layer(positions, q, k, v, meta, rotary)
    assert spy.calls == ["decode_attention_rope"]
    fused_caches = (layer.k_cache.clone(), layer.v_cache.clone())

    spy.calls.clear()
    layer.k_cache, layer.v_cache = caches[0].clone(), caches[1].clone()
    split = layer(positions, q, k, v, meta, rotary, OpPolicy(native=frozenset({"rotary"})))
    assert spy.calls == ["store_kv", "decode_attention"]  # rotary in its PyTorch form
    torch.testing.assert_close(split, fused, rtol=0, atol=0)
    assert torch.equal(layer.k_cache, fused_caches[0]) and torch.equal(layer.v_cache, fused_caches[1])

    # and both equal the three reference ops written out by hand
    kc, vc = caches[0].clone(), caches[1].clone()
    qr, kr = ref.rotary_embedding(positions, q, k, rotary.cos_sin_cache)
    ref.store_kv(kr, v, kc, vc, meta.slot_mapping)
    expected = ref.decode_attention(qr, kc, vc, meta.block_tables, meta.seq_lens, layer.scale)
    torch.testing.assert_close(fused, expected, rtol=0, atol=0)
    assert torch.equal(kc, fused_caches[0])


def test_prefill_never_uses_the_fused_op(monkeypatch):
    spy = OpSpy()
    monkeypatch.setattr(attention_mod, "torch", types.SimpleNamespace(ops=types.SimpleNamespace(ingot=spy)))
    layer, rotary, positions, q, k, v, meta = _layer_and_inputs()
    meta = AttentionMetadata(True, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                             torch.tensor([0, 1, 2], dtype=torch.int32))
    layer(positions, q, k, v, meta, rotary)
    assert spy.calls == ["store_kv", "prefill_attention"]  # rotary ran first, in its own module


def test_skinny_rows_route_small_batches_to_the_skinny_op(monkeypatch):
    """Linear layers send inputs of at most ``policy.skinny_rows`` rows to ingot.skinny_linear."""
    import ingot.layers.linear as linear_mod
    from ingot.layers.linear import Linear

    layer = Linear(24, 40, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    spy = OpSpy()
    monkeypatch.setattr(linear_mod, "torch", types.SimpleNamespace(ops=types.SimpleNamespace(ingot=spy)))
    small, big = torch.randn(4, 24), torch.randn(9, 24)
    policy = OpPolicy(skinny_rows=8)
    torch.testing.assert_close(layer(small, policy), torch.nn.functional.linear(small, layer.weight, layer.bias))
    assert spy.calls == ["skinny_linear"]
    layer(big, policy)  # more rows than the limit: F.linear
    assert spy.calls == ["skinny_linear"]
    layer(small)  # the default policy: off
    assert spy.calls == ["skinny_linear"]


def test_prologues_fuse_on_the_skinny_path_unless_native(monkeypatch):
    """norm_linear / act_mul_linear (SiLU and GeGLU) call the fused ops on the skinny path and
    equal the unfused ops; when compile keeps the norm or activation native, they stay unfused."""
    import ingot.layers.linear as linear_mod
    from ingot.layers.activation import GeluTanhAndMul, SiluAndMul
    from ingot.layers.linear import Linear, act_mul_linear, norm_linear
    from ingot.ops.reference_geglu import gelu_tanh_and_mul
    from ingot.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(5)
    proj, down, norm = Linear(24, 40, bias=True), Linear(20, 24), RMSNorm(24, 1e-6)
    for p in (proj.weight, proj.bias, down.weight, norm.weight):
        p.data.copy_(torch.randn(p.shape, generator=gen))
    x, res, gu = torch.randn(1, 24, generator=gen), torch.randn(1, 24, generator=gen), torch.randn(1, 40, generator=gen)
    spy = OpSpy()
    monkeypatch.setattr(linear_mod, "torch", types.SimpleNamespace(ops=types.SimpleNamespace(ingot=spy)))
    h, new_res = ref.add_rms_norm(x, res, norm.weight, 1e-6)
    skinny = OpPolicy(skinny_rows=1)
    y, r = norm_linear(x, res, norm, proj, skinny)
    z = act_mul_linear(gu, SiluAndMul(), down, skinny)
    g = act_mul_linear(gu, GeluTanhAndMul(), down, skinny)
    assert spy.calls == ["rms_norm_linear", "silu_mul_linear", "gelu_tanh_mul_linear"]
    native = skinny.with_native({"rms_norm", "silu_and_mul", "gelu_tanh_and_mul"})
    y2, _ = norm_linear(x, res, norm, proj, native)
    z2 = act_mul_linear(gu, SiluAndMul(), down, native)
    g2 = act_mul_linear(gu, GeluTanhAndMul(), down, native)
    assert spy.calls[3:] == ["skinny_linear"] * 3
    torch.testing.assert_close(y, torch.nn.functional.linear(h, proj.weight, proj.bias))
    torch.testing.assert_close(r, new_res)
    torch.testing.assert_close(z, torch.nn.functional.linear(ref.silu_and_mul(gu), down.weight))
    torch.testing.assert_close(y2, y)
    torch.testing.assert_close(z2, z)
    torch.testing.assert_close(g, torch.nn.functional.linear(gelu_tanh_and_mul(gu), down.weight))
    torch.testing.assert_close(g2, g)


def test_head_norms_fold_into_the_fused_decode_op(monkeypatch):
    """Qwen3's per-head q/k RMSNorms: decode passes their weights to the one fused op (no
    rms_norm launches); with rotary native they run first, as their own ops; both equal the
    norms, rotary, store and attention written out with the reference ops."""
    import ingot.layers.norm as norm_mod
    from ingot.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(3)
    norms = (RMSNorm(16, 1e-6), RMSNorm(16, 1e-6))
    for n in norms:
        n.weight.data = 1 + 0.3 * torch.randn(16, generator=gen)
    spy = OpSpy()
    for mod in (attention_mod, norm_mod):
        monkeypatch.setattr(mod, "torch", types.SimpleNamespace(ops=types.SimpleNamespace(ingot=spy)))
    layer, rotary, positions, q, k, v, meta = _layer_and_inputs()
    caches = (layer.k_cache.clone(), layer.v_cache.clone())

    fused = layer(positions, q, k, v, meta, rotary, qk_norm=norms)
    assert spy.calls == ["decode_attention_rope"]
    fused_k_cache = layer.k_cache.clone()

    spy.calls.clear()
    layer.k_cache, layer.v_cache = caches[0].clone(), caches[1].clone()
    split = layer(positions, q, k, v, meta, rotary, OpPolicy(native=frozenset({"rotary"})), qk_norm=norms)
    assert spy.calls == ["rms_norm", "rms_norm", "store_kv", "decode_attention"]
    torch.testing.assert_close(split, fused, rtol=0, atol=0)

    kc, vc = caches[0].clone(), caches[1].clone()
    qn, kn = ref.rms_norm(q, norms[0].weight, 1e-6), ref.rms_norm(k, norms[1].weight, 1e-6)
    qr, kr = ref.rotary_embedding(positions, qn, kn, rotary.cos_sin_cache)
    ref.store_kv(kr, v, kc, vc, meta.slot_mapping)
    expected = ref.decode_attention(qr, kc, vc, meta.block_tables, meta.seq_lens, layer.scale)
    torch.testing.assert_close(fused, expected, rtol=0, atol=0)
    assert torch.equal(kc, fused_k_cache)


def test_verify_rows_store_every_row_first_and_equal_a_causal_chunk(monkeypatch):
    """A verify step's rows (``store_first``: three rows of one sequence at positions 5, 6, 7, one
    block table repeated) run rotary, store_kv and decode_attention one by one, never the fused
    op; each row attends causally, as prefill attention of the same three tokens as one chunk."""
    spy = OpSpy()
    monkeypatch.setattr(attention_mod, "torch", types.SimpleNamespace(ops=types.SimpleNamespace(ingot=spy)))
    gen = torch.Generator().manual_seed(4)
    hq, hkv, d, page = 4, 2, 16, 4
    layer = Attention(hq, hkv, d, d**-0.5)
    caches = (torch.randn(4, page, hkv, d, generator=gen), torch.randn(4, page, hkv, d, generator=gen))
    rotary = RotaryEmbedding(d, 64, 10000.0)
    positions = torch.tensor([5, 6, 7])
    slots = torch.tensor([2 * page + 1, 2 * page + 2, 2 * page + 3])  # blocks [1, 2]: positions 4..7 in block 2
    q, k, v = (torch.randn(3, h, d, generator=gen) for h in (hq, hkv, hkv))
    rows = AttentionMetadata(False, slots, torch.tensor([[1, 2]] * 3, dtype=torch.int32),
                             torch.tensor([6, 7, 8], dtype=torch.int32), store_first=True)
    layer.k_cache, layer.v_cache = caches[0].clone(), caches[1].clone()
    out = layer(positions, q, k, v, rows, rotary)
    assert spy.calls == ["store_kv", "decode_attention"]  # rotary ran first, in its own module
    row_caches = (layer.k_cache.clone(), layer.v_cache.clone())

    chunk = AttentionMetadata(True, slots, torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([8], dtype=torch.int32),
                              torch.tensor([0, 3], dtype=torch.int32))
    layer.k_cache, layer.v_cache = caches[0].clone(), caches[1].clone()
    expected = layer(positions, q, k, v, chunk, rotary)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(row_caches[0], layer.k_cache) and torch.equal(row_caches[1], layer.v_cache)
