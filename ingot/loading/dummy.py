"""``load_format="dummy"``: a model's configuration with seeded random weights (vLLM's name).

Decode and serving speed depend on a model's shapes, not its weights, so a user
without the checkpoint (or without network) can still measure a deployment of
that size. The configuration comes from a built-in shape (``SHAPES``, the
``--shape NAME`` shortcut of every command) or from any model ingot opens (HF
directory, hub id, .gguf file), whose weights are then never read.

The tokenizer is ``tokenizer`` when given (``default``: the default model's; a
built-in shape then takes its vocabulary size, so detokenizing costs what it
costs with real weights), else the model's own, else a word-level one that
spells token ``i`` as ``<i>`` (benchmark workloads send token ids, and their
output must still detokenize).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import tokenizers

from ingot.loading.errors import CheckpointError
from ingot.loading.tokenizer import Tokenizer

# HF config.json fields of the built-in shapes.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b": dict(architectures=["Qwen2ForCausalLM"], hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen2.5-7b": dict(architectures=["Qwen2ForCausalLM"], hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
    "llama-3-8b": dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
    "phi-4": dict(architectures=["Phi3ForCausalLM"], hidden_size=5120, intermediate_size=17920, num_hidden_layers=40,
                  num_attention_heads=40, num_key_value_heads=10, vocab_size=100352, max_position_embeddings=16384,
                  rms_norm_eps=1e-5, rope_theta=250000.0, tie_word_embeddings=False),
    "olmo-2-7b": dict(architectures=["Olmo2ForCausalLM"], hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=100352, max_position_embeddings=4096,
                      rms_norm_eps=1e-6, rope_theta=500000.0, tie_word_embeddings=False),
    # mixture of experts (random router weights route about uniformly)
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          tie_word_embeddings=False),
    "qwen1.5-moe-a2.7b": dict(architectures=["Qwen2MoeForCausalLM"], hidden_size=2048, intermediate_size=5632,
                              num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, num_experts=60,
                              num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                              norm_topk_prob=False, decoder_sparse_step=1, vocab_size=151936, max_position_embeddings=8192,
                              rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
    "mixtral-8x7b": dict(architectures=["MixtralForCausalLM"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                         vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
                         tie_word_embeddings=False),
    # sliding-window attention (alternating local and global layers), soft-caps, (1 + w) norms
    "gemma-2-9b": dict(architectures=["Gemma2ForCausalLM"], hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
                       max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096,
                       query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                       tie_word_embeddings=True),
    "gemma-3-12b": dict(architectures=["Gemma3ForCausalLM"], hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=262208,
                        max_position_embeddings=131072, rms_norm_eps=1e-6, sliding_window=1024, sliding_window_pattern=6,
                        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                        query_pre_attn_scalar=256, tie_word_embeddings=True),
    # attention sinks, 128-token windows alternating with full attention (HF's default layer_types: even
    # layers slide), YaRN, biased experts with the clamped SwiGLU
    "gpt-oss-20b": dict(architectures=["GptOssForCausalLM"], hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                        num_experts_per_tok=4, vocab_size=201088, max_position_embeddings=131072, rms_norm_eps=1e-5,
                        sliding_window=128, attention_bias=True,
                        swiglu_alpha=1.702, swiglu_limit=7.0, rope_theta=150000.0,
                        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False, "original_max_position_embeddings": 4096},
                        tie_word_embeddings=False),
    # multi-head latent attention (a 576-value cache entry per token and layer), YaRN, grouped MoE
    # with shared experts after a dense first layer
    "deepseek-v2-lite": dict(architectures=["DeepseekV2ForCausalLM"], hidden_size=2048, intermediate_size=10944,
                             num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
                             q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                             n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, moe_intermediate_size=1408,
                             first_k_dense_replace=1, moe_layer_freq=1, topk_method="greedy", n_group=1, topk_group=1,
                             routed_scaling_factor=1.0, norm_topk_prob=False, vocab_size=102400,
                             max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0,
                             rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                           "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
                             tie_word_embeddings=False),
}
DEFAULT_SHAPE = "qwen2.5-1.5b"
# the context of a built-in shape served with no max_model_len: the bench workloads (prompts up
# to 1024 tokens, outputs up to 512) with room to spare, and a KV pool of a sensible size
SHAPE_CONTEXT = 4096


def shape_config(name: str, vocab_size: Optional[int] = None, num_layers: Optional[int] = None) -> dict[str, Any]:
    """The HF config fields of the built-in shape ``name``, with the vocabulary size or layer
    count replaced when given (fewer layers: a reduced model of the same layer shapes)."""
    if name not in SHAPES:
        raise CheckpointError(f"unknown shape {name!r}; choose from {', '.join(sorted(SHAPES))}")
    fields = dict(SHAPES[name])
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
    return fields


def id_tokenizer(vocab_size: int) -> Tokenizer:
    """Token ``i`` <-> the word ``<i>``; no special tokens, no EOS."""
    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="\x00", cleanup=False)  # joins words with spaces
    return Tokenizer(tok)


def model_tokenizer(path: Path, vocab_size: int, eos_token_ids: list[int]) -> Tokenizer:
    """The tokenizer of an HF directory opened for its configuration alone: its own if it has
    one, else token-id words over its vocabulary."""
    if (path / "tokenizer.json").exists():
        return Tokenizer.from_hf_dir(path, eos_token_ids)
    return id_tokenizer(vocab_size)
