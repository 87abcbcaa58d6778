"""A GGUF of Phi-3 (llama.cpp's ``phi3``) written from a tiny HF checkpoint with partial rotary and LongRoPE.

The writer follows llama.cpp's converter: q/k/v as one ``attn_qkv``, gate and up as one ``ffn_up``,
the LongRoPE factors as ``rope_factors_long`` / ``rope_factors_short`` tensors with the original
context and attention factor as metadata, ``rope.dimension_count`` the rotary dims. ingot's logits
from the F32 file equal transformers' on the checkpoint, and from a Q8_0 file those of the
checkpoint with the file's dequantized weights.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import save_file

from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.loading.errors import CheckpointError
from ingot.loading.gguf import load_gguf
from tests.helpers import hf_logits, ingot_logits, write_tiny_checkpoint
from tests.loading.gguf_fixtures import TO_GGUF, write_gguf
from tests.loading.test_gguf_gemma import IDS, assert_close
from tests.loading.test_gguf_moe import hf_state_dict

PHI3_TO_GGUF = {**TO_GGUF, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
PROJECTIONS = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")
ORIGINAL = 64  # the checkpoint's original_max_position_embeddings: LongRoPE's switch length
LONG_IDS = torch.randint(3, 300, (ORIGINAL + 24,), generator=torch.Generator().manual_seed(5)).tolist()


def engine_logits(path: Path, ids: list[int], max_model_len: int | None) -> torch.Tensor:
    """ingot's logits; the short LongRoPE factors when max_model_len fits the original context (HF
    switches on the sequence length, so a sequence beyond it compares with the long ones)."""
    engine = Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False,
                                 max_model_len=max_model_len))
    return ingot_logits(engine, ids, prefill_len=len(ids) - 6, chunk=(len(ids) - 6) // 2)


def gguf_name(name: str) -> str:
    stem, kind = name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, rest = stem.split(".", 3)
        return f"blk.{layer}.{PHI3_TO_GGUF[rest]}.{kind}"
    return f"{PHI3_TO_GGUF[stem]}.{kind}"


def write_phi3_gguf(hf_dir: Path, out: Path, qtype: QT | None = None, skip: tuple[str, ...] = (),
                    factors: bool = True) -> Path:
    """llama.cpp's Phi-3 converter: the projections in ``qtype`` when given; the metadata keys named
    in ``skip`` left out; without ``factors``, no rope_factors_short tensor."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors: dict = {gguf_name(n): t.float().numpy() for n, t in hf_state_dict(hf_dir).items()}
    if qtype is not None:
        for name in [n for n in tensors if n.split(".")[-2] in PROJECTIONS]:
            tensors[name] = (gguf.quants.quantize(tensors[name], qtype), qtype)
    scaling = cfg["rope_parameters"]
    longrope = scaling.get("rope_type") == "longrope"
    if longrope:
        tensors["rope_factors_long.weight"] = np.array(scaling["long_factor"], dtype=np.float32)
    if longrope and factors:
        tensors["rope_factors_short.weight"] = np.array(scaling["short_factor"], dtype=np.float32)
    ctx, original = cfg["max_position_embeddings"], cfg["original_max_position_embeddings"]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]

    def meta(w: gguf.GGUFWriter) -> None:
        values = {
            "context_length": ctx, "rope.scaling.original_context_length": original,
            "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
            "block_count": cfg["num_hidden_layers"], "attention.head_count": cfg["num_attention_heads"],
            "attention.head_count_kv": cfg["num_key_value_heads"],
            "rope.dimension_count": int(cfg["partial_rotary_factor"] * cfg["hidden_size"]) // cfg["num_attention_heads"],
            "attention.sliding_window": cfg.get("sliding_window") or 0, "vocab_size": cfg["vocab_size"],
        }
        for key, value in values.items():
            if key not in skip:
                w.add_uint32(f"phi3.{key}", value)
        w.add_float32("phi3.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
        w.add_float32("phi3.rope.freq_base", scaling["rope_theta"])
        if longrope:
            scale = ctx / original
            w.add_float32("phi3.rope.scaling.attn_factor",
                          math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
            assert head_dim * cfg["partial_rotary_factor"] == 2 * len(scaling["long_factor"])

    return write_gguf(out, "phi3", tensors=tensors, meta=meta, hparams=False)


def dequantized_checkpoint(hf_dir: Path, out: Path, gguf_path: Path) -> Path:
    """A copy of the HF checkpoint whose projections are the GGUF's, dequantized by the gguf package."""
    shutil.copytree(hf_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    by_name = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    sd = hf_state_dict(hf_dir)
    for name in sd:
        t = by_name[gguf_name(name)]
        if t.tensor_type != QT.F32:
            sd[name] = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    return out


def test_phi3_gguf_logits_match_hf(tmp_path):
    hf_dir = write_tiny_checkpoint(tmp_path / "phi3", "phi3")
    f32 = write_phi3_gguf(hf_dir, tmp_path / "phi3.gguf")
    cfg = load_gguf(f32).config
    assert cfg["architectures"] == ["Phi3ForCausalLM"] and cfg["partial_rotary_factor"] == 0.5
    assert cfg["rope_scaling"]["rope_type"] == "longrope" and cfg["rope_scaling"]["original_max_position_embeddings"] == 64
    assert_close(engine_logits(f32, IDS, ORIGINAL), hf_logits(hf_dir, IDS))
    assert_close(engine_logits(f32, LONG_IDS, None), hf_logits(hf_dir, LONG_IDS))
    q8 = write_phi3_gguf(hf_dir, tmp_path / "phi3-q8_0.gguf", QT.Q8_0)
    assert_close(engine_logits(q8, IDS, ORIGINAL), hf_logits(dequantized_checkpoint(hf_dir, tmp_path / "deq", q8), IDS))


def test_phi3_gguf_matches_transformers_gguf_loading(tmp_path):
    """transformers' own loading of the GGUF gives ingot's logits: the independent check of the
    writer's names and fused layouts. transformers reads neither rope.dimension_count nor the rope
    factors of a phi3 GGUF, so this checkpoint rotates whole heads without LongRoPE."""
    import transformers

    hf_dir = write_tiny_checkpoint(tmp_path / "phi3", "phi3", overrides=dict(partial_rotary_factor=1.0, rope_scaling=None))
    path = write_phi3_gguf(hf_dir, tmp_path / "phi3.gguf", QT.Q8_0)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32,
                                                              pad_token_id=0).eval()
    with torch.no_grad():
        ref = model(torch.tensor([IDS])).logits[0]
    assert_close(engine_logits(path, IDS, None), ref)


@pytest.mark.parametrize(("skip", "factors", "match"), [
    (("rope.scaling.original_context_length",), True, "missing 'phi3.rope.scaling.original_context_length'"),
    ((), False, "rope_factors_long.weight without the other"),
])
def test_phi3_gguf_bad_metadata(tmp_path, skip, factors, match):
    hf_dir = write_tiny_checkpoint(tmp_path / "phi3", "phi3")
    with pytest.raises(CheckpointError, match=match):
        load_gguf(write_phi3_gguf(hf_dir, tmp_path / "bad.gguf", skip=skip, factors=factors))


def test_writer_names_are_llama_cpps(tmp_path):
    """The writer's tensor names are the ones llama.cpp's converter gives (the gguf package's own map)."""
    sd = hf_state_dict(write_tiny_checkpoint(tmp_path / "phi3", "phi3"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, 8)
    assert {gguf_name(n) for n in sd} == {names.get_name(n, try_suffixes=(".weight",)) for n in sd}
