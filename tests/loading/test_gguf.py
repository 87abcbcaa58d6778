"""GGUF reader on tiny models: q/k un-permutation, metadata -> config.

Tiny GGUFs are written with gguf.GGUFWriter into tmp_path (gguf_fixtures.py). Also:
dequantization (test_gguf_dequant.py), tokenizers (test_gguf_tokenizer.py), errors
(test_gguf_errors.py) and the real SmolLM2 GGUF against HF transformers (test_gguf_smollm2.py).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import gguf
import numpy as np
import torch

from ingot.loading.gguf import load_gguf
from tests.loading.gguf_fixtures import gpt2_vocab, tiny_state_dict, to_gguf, weights, write_gguf


def test_tiny_llama_unpermutes_q_and_k(tmp_path: Path) -> None:
    sd = tiny_state_dict(bias=True)  # biases follow their rows through the permutation too
    tensors = to_gguf(sd, permute=True)
    assert not np.array_equal(tensors["blk.0.attn_q.weight"], sd["model.layers.0.self_attn.q_proj.weight"])
    ckpt = load_gguf(write_gguf(tmp_path / "llama.gguf", tensors=tensors))
    it = ckpt.weights(torch.float32)
    assert inspect.isgenerator(it)  # lazy: one tensor at a time
    got = dict(it)
    assert set(got) == set(sd)
    for name, w in sd.items():
        assert torch.equal(got[name], torch.from_numpy(w)), name
    cfg = ckpt.config
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (64, 96, 2)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["rope_theta"] == 10000.0 and cfg["max_position_embeddings"] == 256
    assert cfg["vocab_size"] == len(gpt2_vocab()[0])
    assert cfg["tie_word_embeddings"] is False and cfg["attention_bias"] is True and cfg["rope_scaling"] is None
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 0)


def test_tiny_qwen2_with_biases_is_not_permuted(tmp_path: Path) -> None:
    sd = tiny_state_dict(bias=True, tied=True)
    ckpt = load_gguf(write_gguf(tmp_path / "qwen2.gguf", "qwen2", tensors=to_gguf(sd, permute=False)))
    got = weights(ckpt)
    assert set(got) == set(sd)
    for name, w in sd.items():
        assert torch.equal(got[name], torch.from_numpy(w)), name
    cfg = ckpt.config
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    assert cfg["tie_word_embeddings"] is True and cfg["attention_bias"] is True


def test_tiny_qwen3_qk_norm_and_head_dim(tmp_path: Path) -> None:
    sd = tiny_state_dict(qk_norm=True, head_dim=32)  # head_dim != hidden / heads
    meta = lambda w: (w.add_uint32("qwen3.attention.key_length", 32), w.add_uint32("qwen3.attention.value_length", 32))  # noqa: E731
    ckpt = load_gguf(write_gguf(tmp_path / "qwen3.gguf", "qwen3", tensors=to_gguf(sd, permute=False), meta=meta))
    got = weights(ckpt, torch.float16)
    assert set(got) == set(sd)
    for name, w in sd.items():
        assert torch.equal(got[name], torch.from_numpy(w).half()), name
    cfg = ckpt.config
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["head_dim"] == 32 and cfg["attention_bias"] is False


def test_config_rope_scaling_linear(tmp_path: Path) -> None:
    def meta(w: gguf.GGUFWriter) -> None:
        w.add_string("llama.rope.scaling.type", "linear")
        w.add_float32("llama.rope.scaling.factor", 4.0)
        w.add_uint32("llama.vocab_size", 999)

    cfg = load_gguf(write_gguf(tmp_path / "m.gguf", meta=meta)).config
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert cfg["vocab_size"] == 999  # metadata wins over the token count


def test_config_llama3_rope_from_rope_freqs(tmp_path: Path) -> None:
    """llama.cpp stores Llama 3.1 scaling as a per-frequency divisor tensor; recover the HF params."""
    from ingot.layers.rotary import rope_inv_freq

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    head_dim, theta = 16, 500000.0
    plain = rope_inv_freq(head_dim, theta, None)
    divisors = (plain / rope_inv_freq(head_dim, theta, scaling)).numpy().astype(np.float32)
    assert divisors.max() > 1.0

    def meta(w: gguf.GGUFWriter) -> None:
        w.add_float32("llama.rope.freq_base", theta)

    ckpt = load_gguf(write_gguf(tmp_path / "l3.gguf", tensors={"rope_freqs.weight": divisors}, meta=meta))
    assert ckpt.config["rope_scaling"] == scaling
    assert weights(ckpt) == {}  # rope_freqs is config, not a parameter
