"""GGUF mixture-of-experts files (qwen3moe, qwen2moe, llama with experts = Mixtral) against HF transformers.

Each GGUF is written with the ``gguf`` package from a tiny random HF checkpoint, the way
llama.cpp's converter lays it out (experts stacked per projection into ``ffn_*_exps``,
the router as ``ffn_gate_inp``, the shared expert as ``ffn_*_shexp``, llama q/k rows
permuted); ingot's logits from the GGUF must equal transformers' on the HF checkpoint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import load_file

from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.loading.errors import CheckpointError
from ingot.loading.gguf import load_gguf
from tests.helpers import hf_logits, ingot_logits, write_tiny_checkpoint
from tests.loading.gguf_fixtures import TO_GGUF, gguf_name, gpt2_vocab, llama_cpp_permute, write_gguf

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
MOE_TO_GGUF = {
    **TO_GGUF,
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        sd.update(load_file(file))
    return sd


def to_gguf_tensors(sd: dict[str, torch.Tensor], cfg: dict, arch: str) -> dict[str, np.ndarray]:
    """llama.cpp's converter, for the tensors of these models."""
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, t in sd.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = name.replace(".w1.", ".gate_proj.").replace(".w3.", ".up_proj.").replace(".w2.", ".down_proj.")
        w = t.float().numpy()
        if (m := _EXPERT.match(name)) is not None:
            experts.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = w
            continue
        gname = gguf_name(name, MOE_TO_GGUF)
        if gname.endswith("ffn_gate_inp_shexp.weight"):
            w = w[0]  # stored 1-D, as llama.cpp reads it
        if GGUF_ARCH.get(arch, arch) == "llama" and ("attn_q." in gname or "attn_k." in gname):
            w = llama_cpp_permute(w, cfg["num_attention_heads"] if "attn_q." in gname else cfg["num_key_value_heads"])
        out[gname] = w
    for (layer, proj), per_expert in experts.items():
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([per_expert[e] for e in sorted(per_expert)])
    return out


def write_moe_gguf(hf_dir: Path, out: Path, arch: str, quantize: dict[str, QT] | None = None,
                   blocks: Callable[[np.ndarray, QT], np.ndarray] = gguf.quants.quantize) -> Path:
    """The GGUF of an HF checkpoint of ``arch`` (an MoE one of GGUF_ARCH, or llama / qwen2), with the
    tensors named in ``quantize`` turned into that type's blocks by ``blocks``."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    g = GGUF_ARCH.get(arch, arch)
    tensors: dict = to_gguf_tensors(hf_state_dict(hf_dir), cfg, arch)
    for name, qtype in (quantize or {}).items():
        tensors[name] = (blocks(tensors[name], qtype), qtype)

    def meta(w: gguf.GGUFWriter) -> None:
        heads = cfg["num_attention_heads"]
        w.add_uint32(f"{g}.block_count", cfg["num_hidden_layers"])
        w.add_uint32(f"{g}.context_length", cfg["max_position_embeddings"])
        w.add_uint32(f"{g}.embedding_length", cfg["hidden_size"])
        w.add_uint32(f"{g}.feed_forward_length", cfg["intermediate_size"])
        w.add_uint32(f"{g}.attention.head_count", heads)
        w.add_uint32(f"{g}.attention.head_count_kv", cfg["num_key_value_heads"])
        w.add_uint32(f"{g}.attention.key_length", cfg.get("head_dim") or cfg["hidden_size"] // heads)
        w.add_float32(f"{g}.rope.freq_base", cfg["rope_parameters"]["rope_theta"])
        w.add_float32(f"{g}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
        if arch not in GGUF_ARCH:
            return
        w.add_uint32(f"{g}.expert_count", cfg.get("num_experts") or cfg["num_local_experts"])
        w.add_uint32(f"{g}.expert_used_count", cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            w.add_uint32(f"{g}.expert_feed_forward_length", cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_uint32(f"{g}.expert_shared_feed_forward_length", cfg["shared_expert_intermediate_size"])

    return write_gguf(out, g, tensors=tensors, meta=meta, hparams=False)


@pytest.mark.parametrize("arch", sorted(GGUF_ARCH))
def test_moe_gguf_logits_match_hf(tmp_path, arch):
    hf_dir = write_tiny_checkpoint(tmp_path / arch, arch)
    path = write_moe_gguf(hf_dir, tmp_path / f"{arch}.gguf", arch)
    ckpt = load_gguf(path)
    assert ckpt.config["architectures"] == json.loads((hf_dir / "config.json").read_text())["architectures"]
    engine = Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False))
    ids = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    got = ingot_logits(engine, ids, prefill_len=20, chunk=9)
    ref = hf_logits(hf_dir, ids)
    assert (got - ref).norm() / ref.norm() < 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_moe_gguf_config(tmp_path):
    hf_dir = write_tiny_checkpoint(tmp_path / "q2", "qwen2_moe")
    cfg = load_gguf(write_moe_gguf(hf_dir, tmp_path / "q2.gguf", "qwen2_moe")).config
    assert cfg["num_experts"] == 6 and cfg["num_experts_per_tok"] == 2 and cfg["moe_intermediate_size"] == 32
    assert cfg["shared_expert_intermediate_size"] == 48 and cfg["norm_topk_prob"] is False
    assert cfg["mlp_only_layers"] == [0, 2]  # decoder_sparse_step 2: the layers without a router


def test_quantized_stacked_experts_dequantize_per_row(tmp_path):
    """A Q8_0 [E, I, H] expert tensor comes back as its rows dequantized one by one."""
    hf_dir = write_tiny_checkpoint(tmp_path / "q3", "qwen3_moe")
    name = "blk.0.ffn_up_exps.weight"
    ckpt = load_gguf(write_moe_gguf(hf_dir, tmp_path / "q3.gguf", "qwen3_moe", quantize={name: QT.Q8_0}))
    got = dict(ckpt.weights(torch.float32))["model.layers.0.mlp.experts.up_proj.weight"]
    sd = hf_state_dict(hf_dir)
    stacked = np.stack([sd[f"model.layers.0.mlp.experts.{e}.up_proj.weight"].numpy() for e in range(8)])
    rows = gguf.quants.dequantize(gguf.quants.quantize(stacked.reshape(-1, stacked.shape[-1]), QT.Q8_0), QT.Q8_0)
    assert got.shape == stacked.shape
    assert torch.equal(got, torch.from_numpy(rows.reshape(stacked.shape)))
    assert (got - torch.from_numpy(stacked)).abs().max() < 0.02  # and it is close to the original


def test_moe_gguf_errors(tmp_path):
    with pytest.raises(CheckpointError, match="expert_count"):
        load_gguf(write_gguf(tmp_path / "a.gguf", "qwen3moe", meta=lambda w: (
            w.add_uint32("qwen3moe.block_count", 1), w.add_uint32("qwen3moe.context_length", 64),
            w.add_uint32("qwen3moe.embedding_length", 64), w.add_uint32("qwen3moe.attention.head_count", 4)), hparams=False))
    assert len(gpt2_vocab()[0]) < 384  # the tiny models' ids stay in their own vocabulary
