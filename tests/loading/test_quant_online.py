"""Online quantization of a dense checkpoint (fp8, int8, int4), and the loading layer's
canonical packing against the ops' reference math."""

from __future__ import annotations

import pytest
import torch

from ingot.loading import quant_pack
from ingot.loading.checkpoint import open_checkpoint
from ingot.loading.errors import CheckpointError
from ingot.loading.quant_online import quantize_online, quantize_weight
from ingot.loading.quant_scheme import Fp8Weights, IntWeights
from ingot.ops import reference
from tests.loading.quant_fixtures import llama_config, write_hf_dir

GEN = torch.Generator().manual_seed(0)
WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
PROJ = {"self_attn.q_proj": (128, 128), "self_attn.k_proj": (64, 128), "self_attn.v_proj": (64, 128),
        "self_attn.o_proj": (128, 128), "mlp.gate_proj": (256, 128), "mlp.up_proj": (256, 128),
        "mlp.down_proj": (128, 256)}


def dense_dir(path, hidden=128):
    scale = hidden / 128
    t = {"model.embed_tokens.weight": torch.randn(384, hidden, generator=GEN), "model.norm.weight": torch.ones(hidden),
         "lm_head.weight": torch.randn(384, hidden, generator=GEN),
         "model.layers.0.input_layernorm.weight": torch.ones(hidden),
         "model.layers.0.post_attention_layernorm.weight": torch.ones(hidden)}
    for name, (n, k) in PROJ.items():
        t[f"model.layers.0.{name}.weight"] = torch.randn(int(n * scale), int(k * scale), generator=GEN) * 0.05
    cfg = llama_config(**{**WIDE, "hidden_size": hidden, "intermediate_size": 2 * hidden, "head_dim": hidden // 4})
    return write_hf_dir(path, {k: v.bfloat16() for k, v in t.items()}, None, cfg)


def test_pack_matches_ops_reference():
    for bits in (4, 8):
        u = torch.randint(0, 2**bits, (5, 64), generator=GEN)
        packed = quant_pack.pack_int(u, bits)
        assert torch.equal(packed, reference.pack_int(u, bits))
        assert torch.equal(quant_pack.unpack_int(packed, bits).long(), reference.unpack_int(packed, bits).long())
        scales, zeros = torch.rand(5, 2, generator=GEN).half(), torch.randint(0, 2**bits, (5, 2), dtype=torch.uint8)
        mins = torch.rand(5, 2, generator=GEN).half()
        scheme = IntWeights(bits, 32, has_zeros=True, has_mins=True)
        got = quant_pack.dequantize_int({"qweight": packed, "scales": scales, "zeros": zeros, "mins": mins},
                                        scheme, torch.bfloat16)
        assert torch.equal(got, reference.dequantize_int(packed, scales, zeros, mins, bits, 32, -1, torch.bfloat16))


def test_int8_per_channel_by_hand():
    w = torch.tensor([[0.5, -1.27, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float32)
    t = quantize_weight(w, IntWeights(8, 4))
    assert torch.equal(t["scales"], torch.tensor([[0.01], [1.0]]))  # row max / 127 (an all-zero row: 1)
    u = quant_pack.unpack_int(t["qweight"], 8).long()
    assert u.tolist() == [[128 + 50, 128 - 127, 128 + 25, 128], [128] * 4]


def test_int4_group_by_hand():
    w = torch.zeros(1, 128)
    w[0, :4] = torch.tensor([0.7, -0.35, 0.1, 0.0])
    t = quantize_weight(w, IntWeights(4, 128))
    assert torch.allclose(t["scales"], torch.tensor([[0.1]]), rtol=1e-6)  # group max / 7
    assert quant_pack.unpack_int(t["qweight"], 4)[0, :4].tolist() == [8 + 7, 8 - 4, 8 + 1, 8]  # round(-3.5) = -4


@pytest.mark.parametrize("scheme, bound", [
    (IntWeights(8, 256), 0.5 / 127), (IntWeights(4, 128), 0.5 / 7), (Fp8Weights(0, 0, 0), None)])
def test_round_trip_error(scheme, bound):
    w = (torch.randn(64, 256, generator=GEN) * 0.02).bfloat16()
    t = quantize_weight(w, scheme)
    back = quant_pack.dequantize(t, scheme, torch.float32)
    err = (back - w.float()).abs()
    if isinstance(scheme, Fp8Weights):
        scale = w.float().abs().amax() / 448
        assert torch.allclose(t["weight_scale"], scale.reshape(1, 1))
        assert bool((err <= w.float().abs() / 16 + scale * 2**-9).all())  # e4m3: 3 mantissa bits
    else:
        g = scheme.group_size
        amax = w.float().reshape(64, -1, g).abs().amax(-1)
        assert t["scales"].dtype == torch.float32 and torch.allclose(t["scales"], amax * 2 * bound, rtol=1e-6)
        step = t["scales"].repeat_interleave(g, dim=1)
        assert bool((err <= step / 2 * (1 + 1e-5)).all())  # half a step, up to fp32 rounding


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8"])
def test_open_checkpoint_online(tmp_path, scheme):
    path = dense_dir(tmp_path)
    ckpt = open_checkpoint(str(path), quantization=scheme, dequantize_on_load=False)
    assert ckpt.quant.method == "online" and ckpt.quant.scheme is None
    t = dict(ckpt.weights(torch.bfloat16, None))
    assert len(t) == ckpt.num_tensors
    dense = dict(open_checkpoint(str(path)).weights(torch.bfloat16, None))
    for name in PROJ:
        module = f"model.layers.0.{name}"
        s = ckpt.quant.scheme_for(module)
        expect = quantize_weight(dense[f"{module}.weight"], s)
        assert set(expect) <= {p.rpartition(".")[2] for p in t if p.startswith(module + ".")}
        assert all(torch.equal(t[f"{module}.{p}"].view(torch.uint8), v.view(torch.uint8)) for p, v in expect.items())
        if scheme == "int8":
            assert s == IntWeights(8, PROJ[name][1])
    for name in ("lm_head", "model.embed_tokens"):
        assert ckpt.quant.scheme_for(name) is None and torch.equal(t[f"{name}.weight"], dense[f"{name}.weight"])
    # on CPU: the same rounding, dequantized to the model dtype
    cpu = open_checkpoint(str(path), quantization=scheme)
    assert cpu.quant is None
    d = dict(cpu.weights(torch.float32, None))
    module = "model.layers.0.mlp.down_proj"
    s = ckpt.quant.scheme_for(module)
    assert torch.equal(d[f"{module}.weight"], quant_pack.dequantize(quantize_weight(dense[f"{module}.weight"], s), s,
                                                                    torch.float32))


def test_online_selection(tmp_path):
    path = dense_dir(tmp_path)
    ckpt = open_checkpoint(str(path), quantization="int4", dequantize_on_load=False)
    full = dict(ckpt.weights(torch.bfloat16, None))
    select = lambda name: (slice(0, 64),) if ".gate_proj." in name or name.startswith("lm_head") else None  # noqa: E731
    part = dict(ckpt.weights(torch.bfloat16, select))
    for name in full:
        assert torch.equal(part[name], full[name][select(name)] if select(name) else full[name]), name


def test_online_errors(tmp_path):
    path = dense_dir(tmp_path / "narrow", hidden=64)
    with pytest.raises(CheckpointError, match="not a multiple of the group size 128"):
        open_checkpoint(str(path), quantization="int4")
    with pytest.raises(CheckpointError, match="not quantized"):
        open_checkpoint(str(path), quantization="awq")
    with pytest.raises(CheckpointError, match="not quantized; online quantization is one of fp8, int8, int4"):
        open_checkpoint(str(path), quantization="nf4")
    with pytest.raises(CheckpointError, match="random weights are quantized with one of fp8, int8, int4"):
        open_checkpoint(str(path), load_format="dummy", quantization="awq")
    with pytest.raises(CheckpointError, match="unknown online quantization"):
        quantize_online("int3", {})


def test_random_weights_quantized_online():
    """load_format="dummy" with an online quantization: every linear module quantized, routed
    experts too; the modules online quantization keeps dense (lm_head, embeddings, routers) dense."""
    from ingot.loading.quant_scheme import Fp8Weights, IntWeights

    for scheme, kind in (("int4", IntWeights), ("int8", IntWeights), ("fp8", Fp8Weights)):
        q = open_checkpoint("qwen3-30b-a3b", load_format="dummy", quantization=scheme).quant
        assert isinstance(q.scheme_for("model.layers.3.self_attn.q_proj"), kind)
        assert isinstance(q.scheme_for("model.layers.3.mlp.shared_expert.down_proj"), kind)
        assert isinstance(q.scheme_for("model.layers.3.mlp.experts.7.up_proj"), kind)
        for dense in ("lm_head", "model.embed_tokens", "model.layers.3.mlp.gate", "model.layers.3.mlp.shared_expert_gate"):
            assert q.scheme_for(dense) is None, dense
    assert open_checkpoint("qwen2.5-7b", load_format="dummy", quantization="int8").quant.scheme.group_size == 0


def test_quantized_checkpoint_refuses_another_quantization(smollm2_gguf):
    with pytest.raises(CheckpointError, match="quantized with gguf; quantization='int4' cannot be applied"):
        open_checkpoint(str(smollm2_gguf), quantization="int4")
    assert open_checkpoint(str(smollm2_gguf), quantization="gguf", dequantize_on_load=False).quant.method == "gguf"
