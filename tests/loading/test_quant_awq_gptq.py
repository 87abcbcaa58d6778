"""AutoAWQ (GEMM) and GPTQ checkpoints read into the canonical int form.

The checkpoints are packed here following AutoAWQ's and GPTQ's documented layouts
(``quant_fixtures``); their reference weights are computed element by element from the
unpacked values, and the canonical tensors, dequantized by the ops' reference math,
must equal them exactly.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ingot.loading.checkpoint import open_checkpoint
from ingot.loading.errors import CheckpointError
from ingot.loading.quant_scheme import IntWeights
from ingot.ops.reference import dequantize_int
from tests.loading.quant_fixtures import (
    LINEARS,
    awq_module,
    dense_tensors,
    gptq_module,
    llama_config,
    ref_int,
    write_hf_dir,
)

RNG = np.random.default_rng(0)
SHAPES = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
          "self_attn.o_proj": (64, 64), "mlp.gate_proj": (96, 64), "mlp.up_proj": (96, 64), "mlp.down_proj": (64, 96)}


def random_int(n: int, k: int, bits: int, group: int, sym: bool, g_idx=None):
    """Random unsigned values, zero points (some 0, the v1 wrap-around case) and fp16 scales."""
    groups = k // group
    q = RNG.integers(0, 2**bits, size=(n, k), dtype=np.int64)
    if sym:
        zeros = np.full((n, groups), 2 ** (bits - 1), dtype=np.int64)
    else:
        zeros = RNG.integers(0, 2**bits, size=(n, groups), dtype=np.int64)
        zeros[0, 0] = 0
    scales = RNG.uniform(0.001, 0.02, size=(n, groups)).astype(np.float16)
    g_idx = np.arange(k) // group if g_idx is None else g_idx
    return q, zeros, scales, g_idx


def canonical_weights(path):
    ckpt = open_checkpoint(str(path), dequantize_on_load=False)
    t = dict(ckpt.weights(torch.bfloat16, None))
    assert len(t) == ckpt.num_tensors
    return ckpt, t


def dequant(scheme: IntWeights, t: dict, module: str, dtype=torch.bfloat16) -> torch.Tensor:
    return dequantize_int(t[f"{module}.qweight"], t[f"{module}.scales"], t.get(f"{module}.zeros"), None,
                          scheme.bits, scheme.group_size, scheme.default_zero, dtype)


def build(tmp_path, method: str, qc: dict, bits=4, group=32, sym=False, v1=True, desc_act=False, shards=1,
          modules=None, config=None):
    modules = modules or {f"model.layers.0.{m}": s for m, s in SHAPES.items()}
    tensors = {k: v for k, v in dense_tensors().items()
               if not any(f".{m}." in k for m in LINEARS) and k.rpartition(".")[0] not in modules}
    refs = {}
    for name, (n, k) in modules.items():
        g = group if group > 0 else k
        g_idx = None
        if desc_act:
            g_idx = (np.arange(k) // g)[RNG.permutation(k)]
        q, zeros, scales, g_idx = random_int(n, k, bits, g, sym, g_idx)
        parts = awq_module(q, zeros, scales) if method == "awq" else gptq_module(q, zeros, scales, bits, v1, g_idx)
        tensors.update({f"{name}.{p}": v for p, v in parts.items()})
        refs[name] = (ref_int(q, zeros, scales, g_idx), g_idx)
    path = write_hf_dir(tmp_path, tensors, qc, config, shards)
    return path, refs


def check(path, refs, bits, has_zeros, act_order=False):
    ckpt, t = canonical_weights(path)
    for module, (ref, g_idx) in refs.items():
        scheme = ckpt.quant.scheme_for(module)
        assert isinstance(scheme, IntWeights) and scheme.bits == bits and scheme.has_zeros == has_zeros
        assert scheme.act_order == act_order
        assert t[f"{module}.scales"].dtype == torch.float16
        w = dequant(scheme, t, module)
        if act_order:
            perm = t[f"{module}.perm"]
            assert torch.equal(perm, torch.from_numpy(np.argsort(g_idx, kind="stable")))
            ref = ref[:, perm]
        assert torch.equal(w, ref), module
    dense = dict(open_checkpoint(str(path)).weights(torch.bfloat16, None))
    for module, (ref, _) in refs.items():
        assert torch.equal(dense[f"{module}.weight"], ref), module
    return ckpt, t


AWQ_QC = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
          "modules_to_not_convert": None}


def test_awq_gemm(tmp_path):
    path, refs = build(tmp_path, "awq", AWQ_QC)
    ckpt, t = check(path, refs, 4, has_zeros=True)
    assert ckpt.quant.method == "awq" and ckpt.quant.scheme == IntWeights(4, 32, has_zeros=True)
    assert t["model.layers.0.self_attn.q_proj.zeros"].dtype == torch.uint8
    assert t["lm_head.weight"].dtype == torch.bfloat16


def test_awq_interleaved_order_by_hand():
    """AutoAWQ packs 8 output columns per word in the order 0 2 4 6 1 3 5 7; the converter undoes it."""
    from ingot.loading.quant_config import StoredFormat
    from ingot.loading.quant_formats import convert

    q = np.tile(np.arange(8)[:, None], (1, 32))  # [N = 8, K = 32]: row n holds n
    parts = awq_module(q, np.zeros((8, 1), dtype=np.int64), np.ones((8, 1), dtype=np.float16))
    word = int(parts["qweight"][0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 15 for i in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]
    out = convert("m", StoredFormat("awq", bits=4, group_size=32, symmetric=False), IntWeights(4, 32, has_zeros=True), parts)
    words = out["qweight"]  # canonical: [N, K / 8], row n all n
    assert [int(w) & 15 for w in words[:, 0]] == list(range(8))
    assert torch.equal(words, torch.stack([torch.full((4,), n * 0x11111111, dtype=torch.int64) for n in range(8)])
                       .sub(2**32 * (torch.arange(8)[:, None] >= 8)).to(torch.int32))


GPTQ_CASES = {
    "4bit_sym_v1": dict(bits=4, sym=True, v1=True),
    "4bit_asym_v1": dict(bits=4, sym=False, v1=True),
    "4bit_asym_v2": dict(bits=4, sym=False, v1=False),
    "8bit_asym_v1": dict(bits=8, sym=False, v1=True),
    "8bit_sym_v2": dict(bits=8, sym=True, v1=False),
    "4bit_channel_sym": dict(bits=4, sym=True, v1=True, group=-1),
    "4bit_desc_act": dict(bits=4, sym=False, v1=True, desc_act=True),
    "4bit_desc_act_sym_sharded": dict(bits=4, sym=True, v1=True, desc_act=True, shards=3),
}


@pytest.mark.parametrize("case", sorted(GPTQ_CASES))
def test_gptq(tmp_path, case):
    kw = dict(GPTQ_CASES[case])
    qc = {"quant_method": "gptq", "bits": kw["bits"], "group_size": kw.get("group", 32), "sym": kw["sym"],
          "desc_act": kw.get("desc_act", False), "checkpoint_format": "gptq" if kw["v1"] else "gptq_v2",
          "damp_percent": 0.01, "true_sequential": True, "static_groups": False}
    path, refs = build(tmp_path, "gptq", qc, **kw)
    ckpt, t = check(path, refs, kw["bits"], has_zeros=not kw["sym"], act_order=kw.get("desc_act", False))
    if kw.get("group") == -1:  # one scale per row: the group is each module's K
        assert ckpt.quant.scheme_for("model.layers.0.mlp.down_proj").group_size == 96
        assert ckpt.quant.scheme_for("model.layers.0.mlp.up_proj").group_size == 64
    if kw["sym"]:
        assert "model.layers.0.mlp.up_proj.zeros" not in t


def test_gptq_v1_zero_point_zero_comes_back(tmp_path):
    """A v1 zero point of 0 is stored as -1 (15 in its nibble, borrowing from the next):
    read back word-wise it is 0 again, and its neighbour is untouched."""
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False}
    path, refs = build(tmp_path, "gptq", qc, sym=False, v1=True)
    _, t = canonical_weights(path)
    assert int(t["model.layers.0.self_attn.q_proj.zeros"][0, 0]) == 0


def test_gptq_sym_with_wrong_zeros_is_refused(tmp_path):
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "checkpoint_format": "gptq_v2"}
    path, _ = build(tmp_path, "gptq", qc, sym=True, v1=True)  # v1 zeros (7) under a v2 label
    with pytest.raises(CheckpointError, match="not all 8"):
        canonical_weights(path)


def test_gptq_quantized_lm_head_is_dense(tmp_path):
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "lm_head": True}
    modules = {f"model.layers.0.{m}": s for m, s in SHAPES.items()} | {"lm_head": (384, 64)}
    path, refs = build(tmp_path, "gptq", qc, sym=True, modules=modules)
    ckpt, t = canonical_weights(path)
    assert ckpt.quant.scheme_for("lm_head") is None
    assert torch.equal(t["lm_head.weight"], refs["lm_head"][0]) and "lm_head.qweight" not in t


def test_old_quantize_config_json(tmp_path):
    """AutoGPTQ kept the config in quantize_config.json, not in config.json."""
    qc = {"bits": 4, "group_size": 32, "sym": True, "desc_act": False}
    path, refs = build(tmp_path, "gptq", None, sym=True)
    (path / "quantize_config.json").write_text(json.dumps(qc))
    ckpt, _ = check(path, refs, 4, has_zeros=False)
    assert ckpt.quant.method == "gptq"


MOE_CONFIG = dict(llama_config(), architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=16,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def test_moe_per_expert_modules(tmp_path):
    modules = {f"model.layers.0.{m}": SHAPES[m] for m in LINEARS[:4]}
    for e in range(4):
        modules |= {f"model.layers.0.mlp.experts.{e}.gate_proj": (32, 64), f"model.layers.0.mlp.experts.{e}.up_proj": (32, 64),
                    f"model.layers.0.mlp.experts.{e}.down_proj": (64, 32)}
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False}
    path, refs = build(tmp_path, "gptq", qc, modules=modules, config=MOE_CONFIG)
    # the router stays dense in the file
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.mlp.gate.weight"] = torch.randn(4, 64).bfloat16()
    save_file(tensors, str(path / "model.safetensors"))
    ckpt, t = check(path, refs, 4, has_zeros=True)
    assert "model.layers.0.mlp.experts.3.down_proj.qweight" in t
    assert ckpt.quant.scheme_for("model.layers.0.mlp.gate") is None and t["model.layers.0.mlp.gate.weight"].shape == (4, 64)


def test_stacked_experts_are_refused(tmp_path):
    q, zeros, scales, _ = random_int(32, 64, 4, 32, False)
    parts = gptq_module(q, zeros, scales, 4, True)
    tensors = dense_tensors() | {f"model.layers.0.mlp.experts.gate_up_proj.{p}": torch.stack([v, v]) for p, v in parts.items()}
    path = write_hf_dir(tmp_path, tensors, {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False},
                        MOE_CONFIG)
    with pytest.raises(CheckpointError, match="stacked"):
        open_checkpoint(str(path), dequantize_on_load=False)
