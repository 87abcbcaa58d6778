"""Each layer's sliding window and the Gemma fields, read from HF configs as transformers reads them."""

from __future__ import annotations

from ingot.loading.dummy import SHAPES
from ingot.loading.model_config import ModelConfig

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, vocab_size=100)


def windows(arch: str, **fields) -> tuple[int, ...]:
    return ModelConfig.from_hf(dict(BASE, architectures=[arch], **fields)).layer_windows


def test_rules_without_layer_types():
    assert windows("MistralForCausalLM", sliding_window=8) == (8, 8, 8, 8)
    assert windows("MistralForCausalLM", sliding_window=None) == ()
    # Mistral's HF model ignores `layer_types`; Qwen's slide from `max_window_layers` on, and only when switched on
    assert windows("MistralForCausalLM", sliding_window=8, layer_types=["full_attention"] * 4) == (8, 8, 8, 8)
    assert windows("Qwen2ForCausalLM", sliding_window=8, use_sliding_window=True, max_window_layers=3) == (0, 0, 0, 8)
    assert windows("Qwen2ForCausalLM", sliding_window=32768, use_sliding_window=False, max_window_layers=3) == ()
    assert windows("Qwen2ForCausalLM", sliding_window=32768, max_window_layers=3) == ()  # HF's default: off
    assert windows("Gemma2ForCausalLM", sliding_window=8) == (8, 0, 8, 0)
    assert windows("Gemma3ForCausalLM", sliding_window=8, sliding_window_pattern=2) == (8, 0, 8, 0)


def test_layer_types_win_where_the_model_reads_them():
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert windows("Qwen2ForCausalLM", sliding_window=8, use_sliding_window=True, layer_types=types) == (0, 8, 8, 0)
    assert windows("Gemma3ForCausalLM", sliding_window=8, layer_types=types) == (0, 8, 8, 0)
    cfg = ModelConfig.from_hf(dict(BASE, architectures=["Gemma3ForCausalLM"], sliding_window=8, layer_types=types))
    assert cfg.kv_window is None  # a global layer: no block is handed back early
    assert ModelConfig.from_hf(dict(BASE, architectures=["MistralForCausalLM"], sliding_window=8)).kv_window == 8


def test_gemma_fields():
    g2 = ModelConfig.from_hf(SHAPES["gemma-2-9b"])
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.query_pre_attn_scalar) == (50.0, 30.0, 256.0)
    assert g2.layer_windows[:4] == (4096, 0, 4096, 0) and g2.tie_word_embeddings and g2.local_rope_theta is None
    g3 = ModelConfig.from_hf(SHAPES["gemma-3-12b"])
    assert g3.layer_windows[:6] == (1024,) * 5 + (0,) and (g3.rope_theta, g3.local_rope_theta) == (1e6, 1e4)
    assert (g3.attn_logit_softcap, g3.final_logit_softcap) == (0.0, 0.0)
    # configs written before transformers 5: one rope_theta, the local base apart, a scaling of the global layers
    old = ModelConfig.from_hf(dict(BASE, architectures=["Gemma3ForCausalLM"], sliding_window=512, rope_theta=1e6,
                                   rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert (old.rope_theta, old.local_rope_theta, old.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    assert old.layer_windows == (512, 512, 512, 512)  # pattern 6: the sixth layer would be the global one
