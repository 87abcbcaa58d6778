"""A GGUF of OLMo 2 (llama.cpp's ``olmo2``: norms after the sublayers, q/k norm over the whole
projection, q/k rows not permuted), written from a tiny HF checkpoint: ingot's logits from
it equal transformers' on the checkpoint."""

from __future__ import annotations

import json

import gguf
import torch

from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from tests.helpers import hf_logits, ingot_logits, write_tiny_checkpoint
from tests.loading.gguf_fixtures import TO_GGUF, write_gguf
from tests.loading.test_gguf_moe import hf_state_dict

OLMO2_TO_GGUF = {**TO_GGUF, "post_attention_layernorm": "post_attention_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}


def test_olmo2_gguf_logits_match_hf(tmp_path):
    hf_dir = write_tiny_checkpoint(tmp_path / "olmo2", "olmo2")
    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = {}
    for name, t in hf_state_dict(hf_dir).items():
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, layer, rest = stem.split(".", 3)
            tensors[f"blk.{layer}.{OLMO2_TO_GGUF[rest]}.{kind}"] = t.numpy()
        else:
            tensors[f"{OLMO2_TO_GGUF[stem]}.{kind}"] = t.numpy()

    def meta(w: gguf.GGUFWriter) -> None:
        w.add_uint32("olmo2.block_count", cfg["num_hidden_layers"])
        w.add_uint32("olmo2.context_length", cfg["max_position_embeddings"])
        w.add_uint32("olmo2.embedding_length", cfg["hidden_size"])
        w.add_uint32("olmo2.feed_forward_length", cfg["intermediate_size"])
        w.add_uint32("olmo2.attention.head_count", cfg["num_attention_heads"])
        w.add_uint32("olmo2.attention.head_count_kv", cfg["num_key_value_heads"])
        w.add_float32("olmo2.rope.freq_base", cfg["rope_parameters"]["rope_theta"])
        w.add_float32("olmo2.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])

    path = write_gguf(tmp_path / "olmo2.gguf", "olmo2", tensors=tensors, meta=meta, hparams=False)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False))
    assert engine.executor.model.config.architecture == "Olmo2ForCausalLM"
    ids = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    got = ingot_logits(engine, ids, prefill_len=20, chunk=9)
    ref = hf_logits(hf_dir, ids)
    assert (got - ref).norm() / ref.norm() < 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
