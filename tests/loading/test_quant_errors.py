"""Quantized checkpoints ingot cannot read give one clear CheckpointError naming the field."""

from __future__ import annotations

import json

import pytest
import torch

from ingot.loading.checkpoint import open_checkpoint
from ingot.loading.errors import CheckpointError
from ingot.loading.quant_config import parse
from tests.loading.quant_fixtures import dense_tensors, write_hf_dir

W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
TOKEN = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}


def ct(fmt="pack-quantized", weights=W4, acts=None, **top):
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts, "output_activations": None}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"], **top}


BAD = {
    "awq gemv": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemv"},
                 "version='gemv'"),
    "awq exllama": ({"quant_method": "awq", "bits": 4, "version": "exllama"}, "version='exllama'"),
    "awq no zero point": ({"quant_method": "awq", "bits": 4, "zero_point": False, "version": "gemm"}, "zero_point=False"),
    "gptq bits 3": ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
    "gptq marlin": ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    "gptq dynamic": ({"quant_method": "gptq", "bits": 4, "dynamic": {"+:.*down": {"bits": 8}}}, "dynamic="),
    "gptq pack int16": ({"quant_method": "gptq", "bits": 4, "pack_dtype": "int16"}, "pack_dtype"),
    "ct unknown format": (ct("sparse-24-bitmask"), "format='sparse-24-bitmask'"),
    "ct nvfp4": (ct("nvfp4-pack-quantized"), "format='nvfp4-pack-quantized'"),
    "ct unknown args field": (ct(weights={**W4, "rounding": "stochastic"}), "fields ['rounding']"),
    "ct static fp8 activations": (ct("float-quantized", FP8, {**TOKEN, "strategy": "tensor", "dynamic": False}),
                                  "static activation scales"),
    "ct fp8 dynamic per tensor": (ct("float-quantized", FP8, {**TOKEN, "strategy": "tensor"}), "strategy='tensor'"),
    "ct fp8 activation unknown field": (ct("float-quantized", FP8, {**TOKEN, "smoothing": 0.5}), "fields ['smoothing']"),
    "ct output activations": ({**ct(), "config_groups": {"g": {"targets": ["Linear"], "weights": W4,
                                                               "output_activations": TOKEN}}}, "output_activations"),
    "ct int4 in float format": (ct("float-quantized"), "num_bits=4 in format 'float-quantized'"),
    "ct int2": (ct(weights={**W4, "num_bits": 2}), "num_bits=2"),
    "ct fp8 asymmetric": (ct("float-quantized", {**FP8, "symmetric": False}), "symmetric=False"),
    "ct kv cache": (ct(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    "ct transform": (ct(transform_config={"config_groups": {"u": {}}}), "transform_config"),
    "ct frozen": (ct(quantization_status="frozen"), "quantization_status='frozen'"),
    "ct class target": ({**ct(), "config_groups": {"g": {"targets": ["Embedding"], "weights": W4}}}, "'Embedding'"),
    "ct mxfp4 weights": (ct("mxfp4-pack-quantized", {**W4, "type": "float"}), "format='mxfp4-pack-quantized'"),
    "fp8 static": ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme='static'"),
    "fp8 unknown field": ({"quant_method": "fp8", "activation_scheme": "dynamic", "input_scales": True},
                          "fields ['input_scales']"),
    "fp8 e5m2": ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
    "fp8 fp4 experts": ({"quant_method": "fp8", "expert_dtype": "fp4"}, "expert_dtype='fp4'"),
    "mxfp4": ({"quant_method": "mxfp4", "modules_to_not_convert": []}, "quant_method='mxfp4'"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method='bitsandbytes'"),
    "no method": ({"bits": 4}, "quant_method=None"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_unsupported_configs(case):
    qc, match = BAD[case]
    with pytest.raises(CheckpointError) as info:
        parse(qc)
    message = str(info.value)
    assert match in message and message.startswith("unsupported quantization:")
    assert "Supported: compressed-tensors pack-quantized" in message  # lists what is


def test_unsupported_config_through_open_checkpoint(tmp_path):
    path = write_hf_dir(tmp_path, dense_tensors(), BAD["awq gemv"][0])
    with pytest.raises(CheckpointError, match="version='gemv'"):
        open_checkpoint(str(path))


def test_quantized_tensors_without_config(tmp_path):
    """Once: 'checkpoint tensor ...weight_packed does not belong to LlamaForCausalLM' from the model."""
    tensors = dense_tensors()
    w = tensors.pop("model.layers.0.mlp.down_proj.weight")
    tensors["model.layers.0.mlp.down_proj.weight_packed"] = torch.zeros(w.shape[0], w.shape[1] // 8, dtype=torch.int32)
    path = write_hf_dir(tmp_path, tensors, None)
    with pytest.raises(CheckpointError, match="weight_packed' is quantized, but config.json has no quantization_config"):
        open_checkpoint(str(path))


def test_static_input_scales_in_file_are_refused(tmp_path):
    tensors = dense_tensors()
    q = "model.layers.0.self_attn.q_proj"
    tensors[f"{q}.weight"] = tensors[f"{q}.weight"].to(torch.float8_e4m3fn)
    tensors[f"{q}.weight_scale"] = torch.ones(64, 1)
    tensors[f"{q}.input_scale"] = torch.ones(1)
    path = write_hf_dir(tmp_path, tensors, {**ct("float-quantized", FP8, TOKEN), "ignore": ["re:^(?!.*q_proj).*"]})
    with pytest.raises(CheckpointError, match="input_scale.*static activation"):
        open_checkpoint(str(path))


def test_module_not_targeted(tmp_path):
    tensors = dense_tensors()
    q = "model.layers.0.self_attn.q_proj"
    del tensors[f"{q}.weight"]
    tensors[f"{q}.weight_packed"] = torch.zeros(64, 8, dtype=torch.int32)
    tensors[f"{q}.weight_scale"] = torch.ones(64, 1)
    cfg = ct(weights={**W4, "strategy": "channel", "group_size": None})
    cfg["config_groups"]["group_0"]["targets"] = ["re:.*mlp.*"]
    path = write_hf_dir(tmp_path, tensors, cfg)
    with pytest.raises(CheckpointError, match="stored quantized but no quantization_config group targets it"):
        open_checkpoint(str(path))


def test_quantization_config_must_be_an_object(tmp_path):
    path = write_hf_dir(tmp_path, dense_tensors(), None)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": "int4"}))
    with pytest.raises(CheckpointError, match="not an object"):
        open_checkpoint(str(path))
