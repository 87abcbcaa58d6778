"""Tiny DeepSeek-V2 / V3 checkpoints quantized the ways their releases and community quantizations
come: compressed-tensors W4A16 (``pack-quantized``, groups of 32, packed by compressed-tensors'
own compressor), GPTQ 4-bit (asymmetric, groups of 32, v1 zero points), HF FP8 with block scales
(transformers' fine-grained FP8, DeepSeek-V3's release format, with 16 x 16 blocks for these
widths) and llama.cpp's ``deepseek2`` GGUF with Q4_0 / Q8_0 tensors.

Every linear module of the file is quantized, ``kv_b_proj`` included (ingot holds it dense: it
must come dequantized), but the router (``mlp.gate``), the embeddings and the lm_head. ``dense_sd``
gives each quantized checkpoint's weights dequantized by the formats' own rules, independently of
ingot's converters (compressed-tensors' decompressor, the GPTQ / FP8 definitions written out here,
gguf-py's dequantize), in transformers' names: the reference HF model runs on them.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from tests.helpers import write_tiny_checkpoint
from tests.loading.quant_fixtures import fp8_blocks, gptq_module, write_hf_dir
from tests.loading.test_gguf_deepseek import deepseek_tensors, gguf_name, write_deepseek_gguf
from tests.loading.test_gguf_moe import hf_state_dict

# widths that every format's groups and blocks divide: q_lora_rank (V3's q_b_proj input) 32, and
# 32 nope dims, so that attn_k_b's rows (nope values each) hold whole Q8_0 blocks
OVERRIDES = {"deepseek_v2": dict(qk_nope_head_dim=32),
             "deepseek_v3": dict(q_lora_rank=32, qk_nope_head_dim=32,
                                 rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                                               "beta_fast": 32, "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 0.8})}
GROUP = 32
FP8_BLOCK = (16, 16)  # each head's 16 rope rows fill a block of their own: the rope reorder stays within blocks
_LINEAR = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
           "down_proj")


def tiny_deepseek(root: Path, arch: str) -> Path:
    return write_tiny_checkpoint(root / f"{arch}-hf", arch, overrides=OVERRIDES[arch])


def linear_modules(sd: dict[str, torch.Tensor]) -> list[str]:
    """The checkpoint's linear modules (per-expert ones included), router and lm_head aside."""
    return [n[: -len(".weight")] for n, t in sd.items()
            if n.endswith(".weight") and t.dim() == 2 and n.split(".")[-2] in _LINEAR]


# ---------------------------------------------------------------- compressed-tensors W4A16


def _ct_scheme():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)
    return QuantizationScheme(targets=["Linear"], weights=args)


def _ct_module(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' own quantize and pack of one weight, min-max symmetric scales per group."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    n, k = w.shape
    scale = w.reshape(n, k // GROUP, GROUP).abs().amax(-1).clamp(min=1e-8) / 7.5
    return PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, _ct_scheme())


def _ct_dense(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    return PackedQuantizationCompressor.decompress(parts, _ct_scheme())["weight"].float()


CT_CONFIG = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}}},
             "ignore": ["lm_head", "re:.*mlp.gate$"]}

# ---------------------------------------------------------------- GPTQ 4-bit, asymmetric


def _gptq_codes(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Min-max asymmetric 4-bit codes [N, K], zero points and fp16 scales [N, K / GROUP]."""
    n, k = w.shape
    g = w.double().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-6).half()
    zeros = (-lo / scales.double()).round().clamp(0, 15)
    q = (g / scales.double()[..., None] + zeros[..., None]).round().clamp(0, 15).reshape(n, k)
    return q.long().numpy(), zeros.long().numpy(), scales.numpy()


def _gptq_module(w: torch.Tensor) -> dict[str, torch.Tensor]:
    q, zeros, scales = _gptq_codes(w)
    return gptq_module(q, zeros, scales, 4, v1=True)


def _gptq_dense(w: torch.Tensor) -> torch.Tensor:
    """GPTQ's definition, W[n, k] = (q[n, k] - z[n, g]) * s[n, g] with g = k // group, in fp32."""
    q, zeros, scales = _gptq_codes(w)
    g = np.arange(q.shape[1]) // GROUP
    return torch.from_numpy((q - zeros[:, g]).astype(np.float32) * scales[:, g].astype(np.float32))


GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": False, "desc_act": False}

# ---------------------------------------------------------------- HF FP8, block scales


def _fp8_module(w: torch.Tensor) -> dict[str, torch.Tensor]:
    q, scale = fp8_blocks(w, FP8_BLOCK)
    return {"weight": q, "weight_scale_inv": scale}


def _fp8_dense(w: torch.Tensor) -> torch.Tensor:
    """Each fp8 value times its block's scale_inv (transformers' definition), in fp32."""
    q, scale = fp8_blocks(w, FP8_BLOCK)
    bn, bk = FP8_BLOCK
    return q.float() * scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)


FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(FP8_BLOCK)}

HF_FORMATS = {"compressed-tensors": (_ct_module, CT_CONFIG), "gptq": (_gptq_module, GPTQ_CONFIG),
              "fp8": (_fp8_module, FP8_CONFIG)}


def write_quantized(hf_dir: Path, out: Path, method: str, dense: tuple[str, ...] = ()) -> Path:
    """The checkpoint of ``hf_dir`` with every linear module stored in ``method``'s format, but those
    whose last name part ``dense`` lists (left dense in the file)."""
    quantize, qc = HF_FORMATS[method]
    sd = hf_state_dict(hf_dir)
    modules = [m for m in linear_modules(sd) if m.rpartition(".")[2] not in dense]
    tensors = {n: t for n, t in sd.items() if n[: -len(".weight")] not in modules}
    for module in modules:
        tensors.update({f"{module}.{p}": t for p, t in quantize(sd[f"{module}.weight"]).items()})
    return write_hf_dir(out, tensors, qc, json.loads((hf_dir / "config.json").read_text()))


# ---------------------------------------------------------------- GGUF deepseek2

# one type per projection: q / q_a in Q4_0 with kv_a in Q8_0 (held as one projection: restated in
# a common form), the experts Q4_0 with Q8_0 down, kv_b (whole, or split per head) Q8_0
GGUF_TYPES = {"attn_q": QT.Q4_0, "attn_q_a": QT.Q4_0, "attn_q_b": QT.Q8_0, "attn_kv_a_mqa": QT.Q8_0,
              "attn_kv_b": QT.Q8_0, "attn_k_b": QT.Q8_0, "attn_v_b": QT.Q8_0, "attn_output": QT.Q4_0,
              "ffn_gate": QT.Q8_0, "ffn_up": QT.Q8_0, "ffn_down": QT.Q4_0, "ffn_gate_shexp": QT.Q4_0,
              "ffn_up_shexp": QT.Q4_0, "ffn_down_shexp": QT.Q8_0, "ffn_gate_exps": QT.Q4_0,
              "ffn_up_exps": QT.Q4_0, "ffn_down_exps": QT.Q8_0}


def gguf_types(hf_dir: Path, split_kv_b: bool) -> dict[str, QT]:
    cfg = json.loads((hf_dir / "config.json").read_text())
    names = deepseek_tensors(hf_state_dict(hf_dir), cfg, split_kv_b)
    return {n: GGUF_TYPES[n.split(".")[2]] for n in names if n.startswith("blk.") and n.split(".")[2] in GGUF_TYPES}


def write_quantized_gguf(hf_dir: Path, out: Path, split_kv_b: bool, types: dict[str, QT] | None = None) -> Path:
    return write_deepseek_gguf(hf_dir, out, split_kv_b, quantize=types or gguf_types(hf_dir, split_kv_b))


def _gguf_dense(w: torch.Tensor, qtype: QT) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.float().numpy(), qtype), qtype))


# ---------------------------------------------------------------- references


def dense_sd(hf_dir: Path, method: str, split_kv_b: bool = False) -> dict[str, torch.Tensor]:
    """The state dict of the ``method``-quantized checkpoint of ``hf_dir`` dequantized by the format's
    own rule (GGUF: the types ``gguf_types`` gives), in transformers' names."""
    sd = hf_state_dict(hf_dir)
    out = dict(sd)
    if method == "gguf":
        types = gguf_types(hf_dir, split_kv_b)
        for name, t in sd.items():
            if ".mlp.experts." not in name and gguf_name(name) in types:
                out[name] = _gguf_dense(t, types[gguf_name(name)])
            elif split_kv_b and name.endswith("kv_b_proj.weight"):  # k_b's blocks run along the nope dims
                out[name] = _split_kv_b_dense(hf_dir, t)
        for name, t in sd.items():  # experts: stacked per projection, as the file holds them (rows alike)
            if ".mlp.experts." in name:
                layer, proj = name.split(".")[2], name.split(".")[6].removesuffix("_proj")
                out[name] = _gguf_dense(t, types[f"blk.{layer}.ffn_{proj}_exps.weight"])
        return out
    for module in linear_modules(sd):
        w = sd[f"{module}.weight"]
        if method == "compressed-tensors":
            out[f"{module}.weight"] = _ct_dense(_ct_module(w))
        else:
            out[f"{module}.weight"] = _gptq_dense(w) if method == "gptq" else _fp8_dense(w)
    return out


def _split_kv_b_dense(hf_dir: Path, w: torch.Tensor) -> torch.Tensor:
    cfg = json.loads((hf_dir / "config.json").read_text())
    heads, nope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
    kv_b = w.reshape(heads, -1, w.shape[1])
    k_b = _gguf_dense(kv_b[:, :nope].transpose(1, 2).reshape(-1, nope), GGUF_TYPES["attn_k_b"])
    v_b = _gguf_dense(kv_b[:, nope:].reshape(-1, w.shape[1]), GGUF_TYPES["attn_v_b"])
    k_b = k_b.reshape(heads, w.shape[1], nope).transpose(1, 2)
    return torch.cat((k_b, v_b.reshape(heads, -1, w.shape[1])), dim=1).reshape(w.shape)


def hf_reference(hf_dir: Path, sd: dict[str, torch.Tensor]):
    """transformers' model of ``hf_dir``'s config (fp32, experts in its eager loop) holding ``sd``."""
    from tests.helpers import hf_model

    model = hf_model(hf_dir)
    missing, unexpected = model.load_state_dict(_transformers_layout(model, sd), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model


def _transformers_layout(model, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors stacked into transformers' fused experts (gate rows, then up rows)."""
    target = model.state_dict()
    out = {n: t for n, t in sd.items() if ".mlp.experts." not in n}
    for name in target:
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, e = name.removesuffix("gate_up_proj"), target[name].shape[0]
            out[name] = torch.stack([torch.cat((sd[f"{prefix}{i}.gate_proj.weight"], sd[f"{prefix}{i}.up_proj.weight"]))
                                     for i in range(e)])
        elif name.endswith("mlp.experts.down_proj"):
            prefix, e = name.removesuffix("down_proj"), target[name].shape[0]
            out[name] = torch.stack([sd[f"{prefix}{i}.down_proj.weight"] for i in range(e)])
    return out
