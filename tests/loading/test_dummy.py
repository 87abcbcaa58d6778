"""load_format="dummy": a model's configuration with seeded random weights (built-in shapes,
configuration-only directories, GGUF files), and its tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from ingot import LLM, SamplingParams
from ingot.loading.checkpoint import open_checkpoint
from ingot.loading.dummy import SHAPE_CONTEXT, SHAPES
from ingot.loading.errors import CheckpointError
from ingot.models.loader import load_checkpoint
from tests.helpers import ARCHS, TINY, write_tiny_checkpoint


def test_a_built_in_shape_opens_without_weights_or_files():
    ckpt = open_checkpoint("qwen2.5-7b", load_format="dummy")
    assert ckpt.weights is None and ckpt.max_model_len == SHAPE_CONTEXT
    cfg = ckpt.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads, cfg.vocab_size) == (3584, 28, 4, 152064)
    assert ckpt.tokenizer.vocab_size == 152064 and ckpt.tokenizer.decode([7, 11]) == "<7> <11>"


def test_a_shape_with_another_models_tokenizer_takes_its_vocabulary(smollm2_gguf):
    ckpt = open_checkpoint("qwen2.5-1.5b", tokenizer="default", load_format="dummy")
    assert ckpt.tokenizer.vocab_size == 49152 == ckpt.config.vocab_size
    assert ckpt.tokenizer.encode("Hello") == open_checkpoint(None).tokenizer.encode("Hello")


def test_a_config_directory_gets_random_weights_and_token_id_words(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, **ARCHS["llama"]}))
    ckpt = open_checkpoint(str(tmp_path), load_format="dummy")
    assert ckpt.weights is None and ckpt.tokenizer.vocab_size == TINY["vocab_size"]
    with pytest.raises(CheckpointError, match="no .safetensors"):
        open_checkpoint(str(tmp_path))  # the real weights are missing
    a = load_checkpoint(ckpt, torch.float32, torch.device("cpu"), 64)
    b = load_checkpoint(ckpt, torch.float32, torch.device("cpu"), 64)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), f"{name}: random weights are seeded"
        if name.endswith("norm.weight"):
            assert torch.equal(pa, torch.ones_like(pa))
    assert a.layers[0].self_attn.qkv_proj.weight.std() == pytest.approx(0.02, rel=0.1)


def test_a_checkpoint_with_dummy_weights_keeps_its_config_and_tokenizer(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    real, dummy = open_checkpoint(str(path)), open_checkpoint(str(path), load_format="dummy")
    assert dummy.weights is None and dummy.config == real.config
    assert dummy.tokenizer.encode("hello world") == real.tokenizer.encode("hello world")
    llm = LLM(str(path), load_format="dummy", dtype="float32", device="cpu", show_progress=False)
    out = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    llm.shutdown()


def test_the_default_gguf_with_dummy_weights(smollm2_gguf):
    ckpt = open_checkpoint(None, load_format="dummy")
    assert ckpt.weights is None and ckpt.config.num_layers == 30 and ckpt.tokenizer.vocab_size == 49152


def test_unknown_shape_and_format_are_clear_errors():
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint("no-such-shape", load_format="dummy")
    with pytest.raises(CheckpointError, match="load_format must be one of"):
        open_checkpoint(None, load_format="pt")
    assert "qwen3-30b-a3b" in SHAPES and "mixtral-8x7b" in SHAPES


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_built_in_shape_builds_its_model(name):
    """Each shape's configuration opens and its model (one layer, on the meta device) builds."""
    from ingot.loading.dummy import shape_config
    from ingot.loading.model_config import ModelConfig
    from ingot.models.loader import build_model

    cfg = ModelConfig.from_hf(shape_config(name, num_layers=1))
    model = build_model(cfg, torch.bfloat16, torch.device("meta"), SHAPE_CONTEXT)
    q_kv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    if cfg.mla is not None:  # latent attention: the query and the latent + rope key in one GEMM
        q_kv = cfg.num_heads * cfg.head_dim + cfg.mla.cache_dim
    assert tuple(model.layers[0].self_attn.qkv_proj.weight.shape) == (q_kv, cfg.hidden_size)
