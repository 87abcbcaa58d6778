"""transformers' fine-grained FP8 checkpoints (quant_method "fp8", the official Qwen3 FP8 layout).

The canonical fp8 tensors, dequantized by the ops' reference math, must equal what
transformers gives when it loads the same checkpoint with ``dequantize=True`` on CPU.
"""

from __future__ import annotations

import pytest
import torch

from ingot.loading.checkpoint import open_checkpoint
from ingot.loading.quant_scheme import Fp8Weights
from ingot.ops.reference import dequantize_fp8
from tests.loading.quant_fixtures import LINEARS, dense_tensors, fp8_blocks, hf_dequantized, write_hf_dir


def fp8_checkpoint(path, block, ignore=(), **qc_extra):
    tensors = dense_tensors()
    for name in LINEARS:
        module = f"model.layers.0.{name}"
        if module in ignore:
            continue
        q, scale = fp8_blocks(tensors.pop(f"{module}.weight"), block)
        tensors[f"{module}.weight"], tensors[f"{module}.weight_scale_inv"] = q, scale
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
          "weight_block_size": list(block) if block else None, **qc_extra}
    if ignore:
        qc["modules_to_not_convert"] = list(ignore)
    return write_hf_dir(path, tensors, qc)


@pytest.mark.parametrize("block, act_group", [((32, 32), 32), ((16, 32), 32), (None, 0)])
def test_fp8_matches_transformers(tmp_path, block, act_group):
    path = fp8_checkpoint(tmp_path, block)
    ckpt = open_checkpoint(str(path), dequantize_on_load=False)
    assert ckpt.quant.method == "fp8"
    t = dict(ckpt.weights(torch.bfloat16, None))
    assert len(t) == ckpt.num_tensors
    ref = hf_dequantized(path)
    for name in LINEARS:
        module = f"model.layers.0.{name}"
        scheme = ckpt.quant.scheme_for(module)
        bn, bk = block or (0, 0)
        assert scheme == Fp8Weights(block_n=bn, block_k=bk, act_group=act_group)
        w, s = t[f"{module}.weight"], t[f"{module}.weight_scale"]
        assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and tuple(s.shape) == scheme.grid(*w.shape)
        assert torch.equal(dequantize_fp8(w, s, scheme.block_n, scheme.block_k, torch.bfloat16), ref[module]), module
    dense = dict(open_checkpoint(str(path)).weights(torch.bfloat16, None))
    assert all(torch.equal(dense[f"model.layers.0.{n}.weight"], ref[f"model.layers.0.{n}"]) for n in LINEARS)


def test_modules_to_not_convert(tmp_path):
    down = "model.layers.0.mlp.down_proj"
    path = fp8_checkpoint(tmp_path, (32, 32), ignore=(down,))
    ckpt = open_checkpoint(str(path), dequantize_on_load=False)
    assert ckpt.quant.scheme_for(down) is None and ckpt.quant.scheme_for("model.layers.0.mlp.up_proj") is not None
    t = dict(ckpt.weights(torch.bfloat16, None))
    assert t[f"{down}.weight"].dtype == torch.bfloat16 and f"{down}.weight_scale" not in t


def test_ue8m0_scales(tmp_path):
    """DeepSeek-V4-style power-of-two scales (float8_e8m0fnu) become fp32 exactly."""
    path = fp8_checkpoint(tmp_path, (32, 32), scale_fmt="ue8m0")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("weight_scale_inv")]:
        tensors[name] = torch.exp2(torch.log2(tensors[name]).round()).to(torch.float8_e8m0fnu)
    save_file(tensors, str(path / "model.safetensors"))
    t = dict(open_checkpoint(str(path), dequantize_on_load=False).weights(torch.bfloat16, None))
    raw = tensors["model.layers.0.mlp.up_proj.weight_scale_inv"]
    assert torch.equal(t["model.layers.0.mlp.up_proj.weight_scale"], raw.float())
