"""GGUFs of Gemma 2 and Gemma 3 (llama.cpp's ``gemma2`` / ``gemma3``) written from tiny HF checkpoints.

The writer follows llama.cpp's converter: norms stored as 1 + w, Gemma's pre-MLP norm named
``ffn_norm``, q/k rows not permuted, tied embeddings without ``output``, soft-caps and the sliding
window as metadata, and no attention scale (llama.cpp derives it: 1/sqrt(head_dim) below 27B, so
the checkpoints use query_pre_attn_scalar = head_dim). ingot's logits from the F32 file equal
transformers' on the checkpoint; from a Q8_0 file, those of the checkpoint with the file's
dequantized weights; and both equal transformers' own loading of the same GGUF.
"""

from __future__ import annotations

import json
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
from tests.loading.gguf_fixtures import TO_GGUF, gguf_name, write_gguf
from tests.loading.test_gguf_moe import hf_state_dict

GEMMA_TO_GGUF = {**TO_GGUF, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
# llama.cpp's own rules: attention scale 1/sqrt(head_dim); Gemma 3's one global layer in six, local base 10000
OVERRIDES = {
    "gemma2": dict(query_pre_attn_scalar=16),
    "gemma3": dict(query_pre_attn_scalar=16, num_hidden_layers=6, sliding_window_pattern=6,
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
IDS = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(4)).tolist()


def gemma_tensors(sd: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """llama.cpp's Gemma converter: its names, every norm weight stored as 1 + w, no tied lm_head."""
    out = {}
    for name, t in sd.items():
        if name == "lm_head.weight":
            continue
        gname = gguf_name(name, GEMMA_TO_GGUF)
        w = t.float().numpy()
        out[gname] = w + 1 if gname.endswith("norm.weight") else w
    return out


def write_gemma_gguf(hf_dir: Path, out: Path, arch: str, qtype: QT | None = None, skip: tuple[str, ...] = ()) -> Path:
    """The GGUF llama.cpp's converter writes for a Gemma 2 / 3 checkpoint; the projections in ``qtype``
    when given; the metadata keys named in ``skip`` left out."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors: dict = gemma_tensors(hf_state_dict(hf_dir))
    if qtype is not None:
        for name in [n for n in tensors if n.split(".")[-2] in PROJECTIONS]:
            tensors[name] = (gguf.quants.quantize(tensors[name], qtype), qtype)

    def meta(w: gguf.GGUFWriter) -> None:
        values = {
            "block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
            "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": cfg["num_attention_heads"], "attention.head_count_kv": cfg["num_key_value_heads"],
            "attention.key_length": cfg["head_dim"], "attention.value_length": cfg["head_dim"],
            "attention.sliding_window": cfg["sliding_window"], "vocab_size": cfg["vocab_size"],
        }
        for key, value in values.items():
            if key not in skip:
                w.add_uint32(f"{arch}.{key}", value)
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
        if arch == "gemma2":
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        else:
            w.add_rope_freq_base(cfg["rope_parameters"]["full_attention"]["rope_theta"])

    return write_gguf(out, arch, tensors=tensors, meta=meta, hparams=False)


def dequantized_checkpoint(hf_dir: Path, out: Path, gguf_path: Path) -> Path:
    """A copy of the HF checkpoint whose projections are the GGUF's, dequantized by the gguf package."""
    shutil.copytree(hf_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    sd = hf_state_dict(hf_dir)
    reader = gguf.GGUFReader(gguf_path)
    by_name = {t.name: t for t in reader.tensors}
    for name in sd:
        if name.startswith("model.layers."):
            gname = gguf_name(name, GEMMA_TO_GGUF)
            if gname.split(".")[-2] in PROJECTIONS:
                t = by_name[gname]
                sd[name] = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
    save_file({k: v.contiguous() for k, v in sd.items() if k != "lm_head.weight"}, str(out / "model.safetensors"))
    return out


def engine_logits(path: Path) -> torch.Tensor:
    engine = Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False))
    return ingot_logits(engine, IDS, prefill_len=24, chunk=12)  # two prefill chunks, then decode steps


def assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert (got - ref).norm() / ref.norm() < 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def transformers_logits(path: Path, arch: str) -> torch.Tensor:
    """transformers' own loading of the GGUF. It reads neither the soft-caps nor llama.cpp's attention
    scale rule from a GGUF (it keeps its config defaults), so those come from the checkpoint."""
    import transformers

    cfg = json.loads((path.parent / arch / "config.json").read_text())
    keys = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, **{k: cfg[k] for k in keys}).eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0]


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_logits_match_hf(tmp_path, arch):
    hf_dir = write_tiny_checkpoint(tmp_path / arch, arch, overrides=OVERRIDES[arch])
    f32 = write_gemma_gguf(hf_dir, tmp_path / f"{arch}.gguf", arch)
    q8 = write_gemma_gguf(hf_dir, tmp_path / f"{arch}-q8_0.gguf", arch, QT.Q8_0)
    ckpt = load_gguf(f32)
    assert ckpt.config["architectures"] == json.loads((hf_dir / "config.json").read_text())["architectures"]
    got = engine_logits(f32)
    assert_close(got, hf_logits(hf_dir, IDS))
    assert_close(got, transformers_logits(f32, arch))
    got = engine_logits(q8)
    assert_close(got, hf_logits(dequantized_checkpoint(hf_dir, tmp_path / "deq", q8), IDS))
    assert_close(got, transformers_logits(q8, arch))


def gemma_meta(arch: str, **values: object):
    """Metadata of a tensorless Gemma GGUF (enough for its config); ``values`` replace keys (None drops one)."""
    keys = {"block_count": 4, "context_length": 128, "embedding_length": 64, "feed_forward_length": 128,
            "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 32, **values}

    def meta(w: gguf.GGUFWriter) -> None:
        for key, value in keys.items():
            if isinstance(value, list):
                w.add_array(f"{arch}.{key}", value)
            elif value is not None:
                w.add_uint32(f"{arch}.{key}", value)
    return meta


def test_gemma_gguf_config_rules(tmp_path):
    """llama.cpp's defaults where the file is silent: Gemma 2's soft-caps 50 / 30 and window 4096, every
    other layer global; Gemma 3 one in six global, local rope base 10000; the 27B models' attention
    scale by width (here 46 and 62 layers); a file's own sliding_window_pattern (period or flags)."""
    cfg = load_gguf(write_gguf(tmp_path / "a.gguf", "gemma2", meta=gemma_meta("gemma2"), hparams=False)).config
    assert cfg["attn_logit_softcapping"] == 50.0 and cfg["final_logit_softcapping"] == 30.0
    assert cfg["sliding_window"] == 4096 and cfg["query_pre_attn_scalar"] == 32
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2 and cfg["hidden_act"] == "gelu_pytorch_tanh"
    cfg = load_gguf(write_gguf(tmp_path / "b.gguf", "gemma2", meta=gemma_meta("gemma2", block_count=46),
                               hparams=False)).config
    assert cfg["query_pre_attn_scalar"] == 16
    meta = gemma_meta("gemma3", block_count=62, **{"attention.sliding_window": 512})
    cfg = load_gguf(write_gguf(tmp_path / "c.gguf", "gemma3", meta=meta, hparams=False)).config
    assert cfg["query_pre_attn_scalar"] == 16 and cfg["rope_local_base_freq"] == 10000.0
    assert cfg["final_logit_softcapping"] is None and cfg["model_type"] == "gemma3_text"
    assert [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"] == list(range(5, 62, 6))
    cfg = load_gguf(write_gguf(tmp_path / "d.gguf", "gemma3", meta=gemma_meta("gemma3"), hparams=False)).config
    assert cfg["sliding_window"] is None and set(cfg["layer_types"]) == {"full_attention"}
    flags = [True, False, False, True]
    meta = gemma_meta("gemma3", **{"attention.sliding_window": 64, "attention.sliding_window_pattern": flags})
    cfg = load_gguf(write_gguf(tmp_path / "e.gguf", "gemma3", meta=meta, hparams=False)).config
    assert cfg["layer_types"] == ["sliding_attention" if f else "full_attention" for f in flags]
    meta = gemma_meta("gemma2", **{"attention.sliding_window_pattern": 3})
    cfg = load_gguf(write_gguf(tmp_path / "f.gguf", "gemma2", meta=meta, hparams=False)).config
    assert cfg["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


@pytest.mark.parametrize(("key", "value", "match"), [
    ("embedding_length", None, "missing 'gemma2.embedding_length'"),
    ("attention.sliding_window_pattern", [True, False], "2 entries for 4 layers"),
])
def test_gemma_gguf_bad_metadata(tmp_path, key, value, match):
    meta = gemma_meta("gemma2", **{key: value})
    with pytest.raises(CheckpointError, match=match):
        load_gguf(write_gguf(tmp_path / "bad.gguf", "gemma2", meta=meta, hparams=False))


@pytest.mark.parametrize(("arch", "kind"), [("gemma2", gguf.MODEL_ARCH.GEMMA2), ("gemma3", gguf.MODEL_ARCH.GEMMA3)])
def test_writer_names_are_llama_cpps(tmp_path, arch, kind):
    """The writer's tensor names are the ones llama.cpp's converter gives (the gguf package's own map)."""
    hf_dir = write_tiny_checkpoint(tmp_path / arch, arch, overrides=OVERRIDES[arch])
    sd = hf_state_dict(hf_dir)
    names = gguf.get_tensor_name_map(kind, 8)
    expected = {names.get_name(n, try_suffixes=(".weight",)) for n in sd if n != "lm_head.weight"}
    assert set(gemma_tensors(sd)) == expected
