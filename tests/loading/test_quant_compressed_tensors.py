"""compressed-tensors checkpoints (llm-compressor's format) read into ingot's canonical forms.

Each checkpoint is written by the compressed-tensors library from a tiny random Llama;
the canonical tensors, dequantized by the ops' reference math, must equal exactly what
transformers gives when it loads and dequantizes the same checkpoint on CPU.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ingot.loading.checkpoint import open_checkpoint
from ingot.loading.quant_scheme import Fp8Weights, IntWeights
from ingot.ops.reference import dequantize_fp8, dequantize_int
from tests.loading.quant_fixtures import LINEARS, ct_checkpoint, hf_dequantized

pytest.importorskip("compressed_tensors")

INT_CASES = {
    "w4a16_group_asym": (dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32), "pack-quantized"),
    "w4a16_group_sym": (dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=16), "pack-quantized"),
    "w4a16_channel_asym": (dict(num_bits=4, type="int", symmetric=False, strategy="channel"), "pack-quantized"),
    "w8a16_channel_sym": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"), "pack-quantized"),
    "w8a16_group_asym": (dict(num_bits=8, type="int", symmetric=False, strategy="group", group_size=32), "pack-quantized"),
    "naive_int8_channel": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"), "naive-quantized"),
    "naive_int8_group_asym": (dict(num_bits=8, type="int", symmetric=False, strategy="group", group_size=32),
                              "naive-quantized"),
}
FP8_CASES = {
    "fp8_tensor_w8a16": (dict(num_bits=8, type="float", strategy="tensor"), None, (0, 0, -1)),
    "fp8_channel_dynamic_token": (dict(num_bits=8, type="float", strategy="channel"),
                                  dict(num_bits=8, type="float", strategy="token", dynamic=True), (1, 0, 0)),
    "fp8_block_dynamic_group": (dict(num_bits=8, type="float", strategy="block", block_structure=[32, 32]),
                                dict(num_bits=8, type="float", strategy="group", group_size=32, dynamic=True),
                                (32, 32, 32)),
    "fp8_group_w8a16": (dict(num_bits=8, type="float", strategy="group", group_size=32), None, (1, 32, -1)),
}


def canonical(path, **kw):
    ckpt = open_checkpoint(str(path), dequantize_on_load=False, **kw)
    tensors = dict(ckpt.weights(torch.bfloat16, None))
    assert len(tensors) == ckpt.num_tensors
    return ckpt, tensors


def dequant(scheme, t: dict, module: str, dtype=torch.bfloat16) -> torch.Tensor:
    if isinstance(scheme, Fp8Weights):
        return dequantize_fp8(t[f"{module}.weight"], t[f"{module}.weight_scale"], scheme.block_n, scheme.block_k, dtype)
    return dequantize_int(t[f"{module}.qweight"], t[f"{module}.scales"], t.get(f"{module}.zeros"),
                          t.get(f"{module}.mins"), scheme.bits, scheme.group_size, scheme.default_zero, dtype)


@pytest.fixture(scope="module")
def int_checkpoints(tmp_path_factory):
    return {name: ct_checkpoint(tmp_path_factory.mktemp(name), w, fmt) for name, (w, fmt) in INT_CASES.items()}


@pytest.mark.parametrize("case", sorted(INT_CASES))
def test_int_formats_match_transformers(int_checkpoints, case):
    path = int_checkpoints[case]
    weights, fmt = INT_CASES[case]
    ckpt, t = canonical(path)
    assert ckpt.quant.method == "compressed-tensors"
    assert ckpt.quant.ignore == ("lm_head",)
    ref = hf_dequantized(path)
    for name in LINEARS:
        module = f"model.layers.0.{name}"
        scheme = ckpt.quant.scheme_for(module)
        assert isinstance(scheme, IntWeights) and scheme.bits == weights["num_bits"]
        assert scheme.group_size == weights.get("group_size", ref[module].shape[1])
        assert scheme.has_zeros == (not weights["symmetric"])
        assert t[f"{module}.qweight"].dtype == torch.int32
        assert t[f"{module}.scales"].dtype == torch.bfloat16  # as stored, not cast
        if scheme.has_zeros:
            assert t[f"{module}.zeros"].dtype == torch.uint8
        assert torch.equal(dequant(scheme, t, module), ref[module]), module
    assert ckpt.quant.scheme_for("lm_head") is None
    assert t["lm_head.weight"].dtype == torch.bfloat16 and "lm_head.qweight" not in t
    if fmt == "pack-quantized" and weights["symmetric"]:  # the stored words are the canonical ones, unchanged
        raw = load_file(str(path / "model.safetensors"))
        assert torch.equal(t["model.layers.0.mlp.up_proj.qweight"], raw["model.layers.0.mlp.up_proj.weight_packed"])


@pytest.mark.parametrize("case", sorted(FP8_CASES))
def test_fp8_formats_match_transformers(tmp_path, case):
    weights, acts, (bn, bk, act_group) = FP8_CASES[case]
    path = ct_checkpoint(tmp_path, weights, "float-quantized", acts)
    ckpt, t = canonical(path)
    ref = hf_dequantized(path)
    for name in LINEARS:
        module = f"model.layers.0.{name}"
        scheme = ckpt.quant.scheme_for(module)
        assert scheme == Fp8Weights(block_n=bn, block_k=bk, act_group=act_group)
        w, s = t[f"{module}.weight"], t[f"{module}.weight_scale"]
        assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert tuple(s.shape) == scheme.grid(*w.shape)
        assert torch.equal(dequant(scheme, t, module), ref[module]), module


def test_dequantize_on_load_and_fp32(int_checkpoints):
    path = int_checkpoints["w4a16_group_asym"]
    ckpt = open_checkpoint(str(path))  # the default for now: dense
    assert ckpt.quant is None
    dense = dict(ckpt.weights(torch.float32, None))
    assert len(dense) == ckpt.num_tensors
    ref = hf_dequantized(path)
    _, t = canonical(path)
    scheme = open_checkpoint(str(path), dequantize_on_load=False).quant.scheme
    for name in LINEARS:
        module = f"model.layers.0.{name}"
        assert dense[f"{module}.weight"].dtype == torch.float32
        assert torch.equal(dense[f"{module}.weight"].bfloat16(), ref[module])
        assert torch.equal(dense[f"{module}.weight"], dequant(scheme, t, module, torch.float32))


def test_tensor_parallel_selection_applies_to_canonical_names(int_checkpoints):
    path = int_checkpoints["w4a16_group_asym"]
    _, full = canonical(path)
    rank, world = 1, 2

    def select(name):
        if name.endswith((".qweight", ".scales", ".zeros")) and ".q_proj." in name:
            rows = full[name].shape[0] // world
            return (slice(rank * rows, (rank + 1) * rows),)
        if name.endswith(".o_proj.qweight"):  # row parallel: a slice of the packed K words
            words = full[name].shape[1] // world
            return (slice(None), slice(rank * words, (rank + 1) * words))
        return None

    ckpt = open_checkpoint(str(path), dequantize_on_load=False)
    part = dict(ckpt.weights(torch.bfloat16, select))
    assert part.keys() == full.keys()
    for name, tensor in part.items():
        index = select(name)
        assert torch.equal(tensor, full[name] if index is None else full[name][index]), name
    assert part["model.layers.0.self_attn.q_proj.qweight"].shape[0] == full["model.layers.0.self_attn.q_proj.qweight"].shape[0] // 2


def test_actorder_group_g_idx(int_checkpoints, tmp_path):
    """Older compressed-tensors checkpoints (actorder "group") store weight_g_idx; the columns come
    sorted by group with ``perm``, and x[:, perm] @ W_canonical.T == x @ W.T."""
    import shutil

    src = int_checkpoints["w4a16_group_sym"]
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    module = "model.layers.0.mlp.down_proj"
    k = 96
    g_idx = (torch.arange(k) // 16)[torch.randperm(k, generator=gen)].to(torch.int32)  # groups scattered over K
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        kk = tensors[name].shape[1] * 8
        tensors[name.replace("weight_packed", "weight_g_idx")] = g_idx if kk == k else torch.arange(kk, dtype=torch.int32) // 16
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    ckpt, t = canonical(tmp_path)
    scheme = ckpt.quant.scheme_for(module)
    assert scheme.act_order and t[f"{module}.perm"].dtype == torch.int64
    # the reference, element by element: W[n, k] = (u[n, k] - 8) * s[n, g_idx[k]]
    raw = tensors[f"{module}.weight_packed"]
    u = torch.stack([(raw >> (4 * i)) & 15 for i in range(8)], dim=-1).reshape(raw.shape[0], k).float()
    ref = ((u - 8) * tensors[f"{module}.weight_scale"].float()[:, g_idx.long()]).bfloat16()
    w = dequant(scheme, t, module)
    perm = t[f"{module}.perm"]
    assert torch.equal(w, ref[:, perm])
    x = torch.randn(3, k, generator=gen).bfloat16()
    assert torch.allclose(x[:, perm].float() @ w.float().T, x.float() @ ref.float().T, atol=1e-4)
    dense = dict(open_checkpoint(str(tmp_path)).weights(torch.bfloat16, None))
    assert torch.equal(dense[f"{module}.weight"], ref)  # dequantize_on_load undoes perm
    # the contiguous g_idx of the other modules changes nothing
    assert torch.equal(dequant(scheme, t, "model.layers.0.mlp.up_proj"), hf_dequantized(src)["model.layers.0.mlp.up_proj"])


def test_per_module_records_what_the_file_holds(int_checkpoints, tmp_path):
    """A module the config would quantize but the file stores dense (here the whole q_proj, as an
    ignore entry written differently would leave it) is listed dense in per_module."""
    import shutil

    shutil.copytree(int_checkpoints["w8a16_channel_sym"], tmp_path, dirs_exist_ok=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj"
    for part in ("weight_packed", "weight_scale", "weight_shape"):
        del tensors[f"{q}.{part}"]
    tensors[f"{q}.weight"] = torch.randn(64, 64).bfloat16()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ckpt, t = canonical(tmp_path)
    assert ckpt.quant.scheme_for(q) is None and t[f"{q}.weight"].shape == (64, 64)
    # channel-wise scales: group = K, so down_proj (K = 96) differs from the common K = 64
    assert ckpt.quant.scheme_for("model.layers.0.mlp.down_proj").group_size == 96
    assert ckpt.quant.scheme_for("model.layers.0.mlp.up_proj").group_size == 64
