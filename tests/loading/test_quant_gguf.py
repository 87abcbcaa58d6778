"""GGUF projections served in the canonical int form (Q8_0 / Q4_0 / Q4_1 here; the K-quants
in test_gguf_kquants.py).

Written with the gguf package's own quantizer; the canonical tensors, dequantized by the
ops' reference math in fp32, must equal bit for bit the gguf package's ``dequantize``
(with llama.cpp's q/k row order undone), which is what the dense path yields. Shards of one
projection ingot holds as one (q/k/v) in different types come in one common form.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ingot.loading.checkpoint import open_checkpoint
from ingot.loading.errors import CheckpointError
from ingot.loading.gguf import load_gguf
from ingot.loading.gguf_quant import blocks_to_canonical, native_form
from ingot.loading.quant_scheme import IntWeights
from ingot.ops.reference import dequantize_int
from tests.loading.gguf_blocks import REFERENCES, random_blocks
from tests.loading.gguf_fixtures import tiny_state_dict, to_gguf, write_gguf

TYPES = {  # q/k/v in three types (held in one common form), gate/up in one, an f16 one left dense
    "attn_q": QT.Q4_1, "attn_k": QT.Q8_0, "attn_v": QT.Q4_0, "attn_output": QT.F16,
    "ffn_gate": QT.Q4_0, "ffn_up": QT.Q4_0, "ffn_down": QT.Q4_1,
}
COMMON = IntWeights(bits=8, group_size=32, zero_point=0, has_mins=True)  # q/k/v's


def dequant(scheme: IntWeights, t: dict, module: str) -> torch.Tensor:
    return dequantize_int(t[f"{module}.qweight"], t[f"{module}.scales"], None, t.get(f"{module}.mins"),
                          scheme.bits, scheme.group_size, scheme.default_zero, torch.float32)


def write_typed(path: Path, types: dict) -> Path:
    tensors = to_gguf(tiny_state_dict(), permute=True)
    for name in list(tensors):
        kind = name.split(".")[-2]
        if name.endswith(".weight") and kind in types and types[kind] != QT.F16:
            tensors[name] = (gguf.quants.quantize(tensors[name], types[kind]), types[kind])
        elif kind in types:
            tensors[name] = tensors[name].astype(np.float16)
    tensors["output.weight"] = (gguf.quants.quantize(tensors["output.weight"], QT.Q8_0), QT.Q8_0)  # stays dense
    return write_gguf(path, tensors=tensors)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> Path:
    return write_typed(tmp_path_factory.mktemp("gguf") / "mixed.gguf", TYPES)


def test_canonical_equals_gguf_dequantize(mixed_gguf):
    g = load_gguf(mixed_gguf)
    quant = g.quant
    assert quant.method == "gguf" and quant.scheme is None
    dense = dict(g.weights(torch.float32))  # the gguf package's dequantize, q/k rows unpermuted
    canon = dict(g.weights(torch.float32, dequantize=False))
    assert len(canon) == g.tensor_count(False) and len(dense) == g.tensor_count(True) == g.num_tensors
    for layer in range(2):
        for hf, kind in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                         ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down")):
            module = f"model.layers.{layer}.{hf}"
            scheme = quant.scheme_for(module)
            common = kind in ("attn_q", "attn_k", "attn_v")
            assert scheme == (COMMON if common else native_form(TYPES[kind]).scheme)
            assert canon[f"{module}.scales"].dtype == (torch.float32 if common else torch.float16)
            assert (f"{module}.mins" in canon) == (common or TYPES[kind] == QT.Q4_1)
            assert torch.equal(dequant(scheme, canon, module), dense[f"{module}.weight"]), module
        o = f"model.layers.{layer}.self_attn.o_proj"
        assert quant.scheme_for(o) is None and torch.equal(canon[f"{o}.weight"], dense[f"{o}.weight"])
    assert quant.scheme_for("lm_head") is None and torch.equal(canon["lm_head.weight"], dense["lm_head.weight"])
    assert torch.equal(canon["model.norm.weight"], dense["model.norm.weight"])


@pytest.mark.parametrize("qtype", list(REFERENCES), ids=lambda q: q.name)
def test_blocks_by_hand(qtype):
    """Against the scalar block references (ggml's layouts, element by element), K-quants included."""
    ref, f16_at = REFERENCES[qtype]
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = random_blocks(qtype, 3 * 2, f16_at)  # 3 rows of 2 blocks
    raw = blocks.reshape(3, -1)
    out = blocks_to_canonical(torch.from_numpy(raw), qtype)
    scheme = native_form(qtype).scheme
    w = dequantize_int(out["qweight"], out["scales"], None, out.get("mins"), scheme.bits, scheme.group_size,
                       scheme.default_zero, torch.float32)
    expect = [sum((ref(b) for b in blocks[2 * r : 2 * r + 2]), []) for r in range(3)]
    assert torch.equal(w, torch.tensor(expect, dtype=torch.float32))


def test_a_projection_of_quantized_and_float_parts_is_refused(tmp_path):
    path = write_typed(tmp_path / "bad.gguf", {**TYPES, "ffn_up": QT.F16})
    g = load_gguf(path)
    with pytest.raises(CheckpointError, match=r"'blk\.0\.ffn_up\.weight' is F16 but 'blk\.0\.ffn_gate\.weight' is "
                                              r"Q4_0: ingot holds layers\.0\.mlp\.gate_up_proj as one projection"):
        g.quant
    assert open_checkpoint(str(path)).quant is None  # dequantized at load, as before
    with pytest.raises(CheckpointError, match="ffn_up"):
        open_checkpoint(str(path), dequantize_on_load=False)


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
                          {"blk.0.ffn_gate_exps.weight": QT.Q8_0, "blk.0.ffn_up_exps.weight": QT.Q8_0,
                           "blk.0.ffn_down_exps.weight": QT.Q4_0, "blk.2.ffn_gate_exps.weight": QT.Q4_1,
                           "blk.2.ffn_up_exps.weight": QT.Q4_1, "blk.2.ffn_down_exps.weight": QT.Q4_1})
    g = load_gguf(path)
    quant = g.quant
    dense = dict(g.weights(torch.float32))
    canon = dict(g.weights(torch.float32, dequantize=False))
    assert len(canon) == g.tensor_count(False)
    for layer, scheme in ((0, COMMON), (2, native_form(QT.Q4_1).scheme)):  # layer 0: Q8_0 and Q4_0 in one form
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stacked = dense[f"model.layers.{layer}.mlp.experts.{proj}.weight"]
            for e in range(stacked.shape[0]):
                module = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                assert quant.scheme_for(module) == scheme
                assert torch.equal(dequant(scheme, canon, module), stacked[e]), module
            assert f"model.layers.{layer}.mlp.experts.{proj}.weight" not in canon
    assert quant.scheme_for("model.layers.0.mlp.gate") is None  # the router is never quantized


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
