"""GGUF Q8_0 / Q4_0 / Q4_1 projections served in the canonical int form (group 32).

Written with the gguf package's own quantizer; the canonical tensors, dequantized by the
ops' reference math in fp32, must equal bit for bit the gguf package's ``dequantize``
(with llama.cpp's q/k row order undone), which is what the dense path yields.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ingot.loading.checkpoint import open_checkpoint
from ingot.loading.gguf import load_gguf
from ingot.loading.gguf_quant import blocks_to_canonical
from ingot.loading.quant_scheme import IntWeights
from ingot.ops.reference import dequantize_int
from tests.loading.test_gguf import ref_q4_0, ref_q4_1, ref_q8_0, to_gguf, tiny_state_dict, write_gguf

TYPES = {  # one projection type per module, with a K-quant and an f16 one left dense
    "attn_q": QT.Q4_1, "attn_k": QT.Q8_0, "attn_v": QT.Q4_0, "attn_output": QT.Q8_0,
    "ffn_gate": QT.Q4_0, "ffn_up": QT.F16, "ffn_down": QT.Q4_1,
}


def dequant(scheme: IntWeights, t: dict, module: str) -> torch.Tensor:
    return dequantize_int(t[f"{module}.qweight"], t[f"{module}.scales"], None, t.get(f"{module}.mins"),
                          scheme.bits, scheme.group_size, scheme.default_zero, torch.float32)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> Path:
    tensors = to_gguf(tiny_state_dict(), permute=True)
    for name in list(tensors):
        kind = name.split(".")[-2]
        if name.endswith(".weight") and kind in TYPES and TYPES[kind] != QT.F16:
            tensors[name] = (gguf.quants.quantize(tensors[name], TYPES[kind]), TYPES[kind])
        elif kind in TYPES:
            tensors[name] = tensors[name].astype(np.float16)
    tensors["output.weight"] = (gguf.quants.quantize(tensors["output.weight"], QT.Q8_0), QT.Q8_0)  # stays dense
    return write_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf", tensors=tensors)


def test_canonical_equals_gguf_dequantize(mixed_gguf):
    g = load_gguf(mixed_gguf)
    quant = g.quant
    assert quant.method == "gguf" and quant.scheme is None
    dense = dict(g.weights(torch.float32))  # the gguf package's dequantize, q/k rows unpermuted
    canon = dict(g.weights(torch.float32, dequantize=False))
    assert len(canon) == g.tensor_count(False) and len(dense) == g.tensor_count(True) == g.num_tensors
    for layer in range(2):
        for hf, kind in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                         ("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"), ("mlp.down_proj", "ffn_down")):
            module = f"model.layers.{layer}.{hf}"
            scheme = quant.scheme_for(module)
            assert scheme.group_size == 32 and scheme.bits == (8 if TYPES[kind] == QT.Q8_0 else 4)
            assert canon[f"{module}.scales"].dtype == torch.float16
            assert (f"{module}.mins" in canon) == (TYPES[kind] == QT.Q4_1)
            assert torch.equal(dequant(scheme, canon, module), dense[f"{module}.weight"]), module
        up = f"model.layers.{layer}.mlp.up_proj"
        assert quant.scheme_for(up) is None and torch.equal(canon[f"{up}.weight"], dense[f"{up}.weight"])
    assert quant.scheme_for("lm_head") is None and torch.equal(canon["lm_head.weight"], dense["lm_head.weight"])
    assert torch.equal(canon["model.norm.weight"], dense["model.norm.weight"])


@pytest.mark.parametrize("qtype, ref", [(QT.Q8_0, ref_q8_0), (QT.Q4_0, ref_q4_0), (QT.Q4_1, ref_q4_1)])
def test_blocks_by_hand(qtype, ref):
    """Against the scalar block references (ggml's layouts, element by element): nibble j and j + 16 of byte j."""
    rng = np.random.default_rng(1)
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(3, 2 * size), dtype=np.uint8)  # 3 rows of 2 blocks
    for row in raw:
        for b in range(2):
            for at in ((0, 2) if qtype == QT.Q4_1 else (0,)):
                row[b * size + at : b * size + at + 2] = np.array([rng.uniform(0.001, 0.05)], np.float16).view(np.uint8)
    out = blocks_to_canonical(torch.from_numpy(raw), qtype)
    scheme = {QT.Q8_0: IntWeights(8, 32, zero_point=128), QT.Q4_0: IntWeights(4, 32, zero_point=8),
              QT.Q4_1: IntWeights(4, 32, zero_point=0, has_mins=True)}[qtype]
    w = dequantize_int(out["qweight"], out["scales"], None, out.get("mins"), scheme.bits, 32, scheme.default_zero,
                       torch.float32)
    expect = [sum((ref(row[b * size:(b + 1) * size]) for b in range(2)), []) for row in raw]
    assert torch.equal(w, torch.tensor(expect, dtype=torch.float32))


def test_open_checkpoint_and_selection(mixed_gguf):
    ckpt = open_checkpoint(str(mixed_gguf), dequantize_on_load=False)
    assert ckpt.quant.method == "gguf"
    q = "model.layers.0.self_attn.q_proj"

    def select(name):  # rank 1 of 2 along the rows (q_proj only)
        return (slice(32, 64),) if name.startswith(q + ".") else None

    full = dict(ckpt.weights(torch.float32, None))
    part = dict(ckpt.weights(torch.float32, select))
    assert len(full) == ckpt.num_tensors
    for name in (f"{q}.qweight", f"{q}.scales", f"{q}.mins"):
        assert torch.equal(part[name], full[name][32:64])
    dense = open_checkpoint(str(mixed_gguf))  # the default: dequantized, as before
    assert dense.quant is None and dense.num_tensors == len(dict(dense.weights(torch.float32, None)))


def test_stacked_experts_split_per_expert(tmp_path):
    from tests.helpers import write_tiny_checkpoint
    from tests.loading.test_gguf_moe import write_moe_gguf

    hf_dir = write_tiny_checkpoint(tmp_path / "hf", "qwen3_moe")
    path = write_moe_gguf(hf_dir, tmp_path / "moe.gguf", "qwen3_moe",
                          {"blk.0.ffn_gate_exps.weight": QT.Q8_0, "blk.0.ffn_down_exps.weight": QT.Q4_0,
                           "blk.0.attn_q.weight": QT.Q4_1})
    g = load_gguf(path)
    quant = g.quant
    dense = dict(g.weights(torch.float32))
    canon = dict(g.weights(torch.float32, dequantize=False))
    assert len(canon) == g.tensor_count(False)
    for proj in ("gate_proj", "down_proj"):
        stacked = dense[f"model.layers.0.mlp.experts.{proj}.weight"]
        for e in range(stacked.shape[0]):
            module = f"model.layers.0.mlp.experts.{e}.{proj}"
            assert torch.equal(dequant(quant.scheme_for(module), canon, module), stacked[e]), module
        assert f"model.layers.0.mlp.experts.{proj}.weight" not in canon
    # up_proj stays stacked and dense; the router is never quantized
    assert torch.equal(canon["model.layers.0.mlp.experts.up_proj.weight"], dense["model.layers.0.mlp.experts.up_proj.weight"])
    assert quant.scheme_for("model.layers.0.mlp.experts.0.up_proj") is None
    assert quant.scheme_for("model.layers.0.mlp.gate") is None


def test_default_model_first_layer(smollm2_gguf):
    """The shipped SmolLM2 Q4_1 GGUF: the first layer's projections, canonical against dense."""
    g = load_gguf(smollm2_gguf)
    want = {f"model.layers.0.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj")}
    keep = [entry for entry in g._tensors if entry[0].rpartition(".")[0] in want]
    sub = type(g)(**{**g.__dict__, "_tensors": keep})
    dense = dict(sub.weights(torch.float32))
    canon = dict(sub.weights(torch.float32, dequantize=False))
    for module in want:
        assert torch.equal(dequant(g.quant.scheme_for(module), canon, module), dense[f"{module}.weight"]), module
