"""Test helpers: tiny random HF checkpoints written to disk, and ingot logits per position."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=384,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
)

ARCHS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=False, head_dim=32),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", tie_word_embeddings=False, sliding_window=None),
    # mixture of experts: every routing feature of the four families, at least one dense layer where they have them
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", tie_word_embeddings=False, head_dim=32,
                      num_hidden_layers=3, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                      norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2_moe": dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", tie_word_embeddings=False,
                      num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      norm_topk_prob=False, decoder_sparse_step=2, num_hidden_layers=3),
    "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", tie_word_embeddings=False,
                    num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, sliding_window=None),
    "olmoe": dict(architectures=["OlmoeForCausalLM"], model_type="olmoe", tie_word_embeddings=False,
                  num_experts=8, num_experts_per_tok=2, intermediate_size=32, clip_qkv=2.0, pad_token_id=0),
    # dense variations: Phi-3 (fused qkv / gate_up tensors, partial rotary, LongRoPE over the first
    # 64 positions), OLMo 2 (norms after the sublayers), SmolLM3 (layer 1 without rotary)
    "phi3": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", tie_word_embeddings=False, pad_token_id=0,
                 partial_rotary_factor=0.5, original_max_position_embeddings=64,
                 rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 2.1, 3.4],
                               "long_factor": [1.7, 2.9, 4.4, 8.0]}),
    "olmo2": dict(architectures=["Olmo2ForCausalLM"], model_type="olmo2", tie_word_embeddings=False, pad_token_id=0),
    "smollm3": dict(architectures=["SmolLM3ForCausalLM"], model_type="smollm3", tie_word_embeddings=True, pad_token_id=0,
                    num_hidden_layers=3, no_rope_layer_interval=2),
    # Gemma: tied embeddings, soft-caps (Gemma 2), q/k norms and two rope bases (Gemma 3); windows of 8
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", head_dim=16, sliding_window=8,
                   query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=16, sliding_window=8,
                   num_hidden_layers=3, sliding_window_pattern=3, query_pre_attn_scalar=24,
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}}),
}
# DeepSeek: latent attention (V2 without, V3 with the query's low-rank path), YaRN (V3: an
# attention factor other than 1), a dense first layer, grouped routing (V2 by the best expert,
# V3 by the best two, sigmoid with a correction bias), shared experts
_DEEPSEEK = dict(tie_word_embeddings=False, num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=1.5)
ARCHS["deepseek_v2"] = dict(_DEEPSEEK, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", q_lora_rank=None,
                            n_shared_experts=2, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                          "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})
ARCHS["deepseek_v3"] = dict(_DEEPSEEK, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", q_lora_rank=24,
                            n_shared_experts=1, n_group=2, topk_group=1, norm_topk_prob=True,
                            rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8})
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
DENSE_FAMILIES = ("phi3", "olmo2", "smollm3")


def write_tokenizer(path: Path, vocab_size: int = 300) -> None:
    """Train a small byte-level BPE tokenizer and save tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello world, hello tokens!", "def f(x): return x * 2"]
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))


def write_tiny_checkpoint(
    path: Path, arch: str, seed: int = 0, fused_experts: bool = False, overrides: dict | None = None
) -> Path:
    """A random HF checkpoint (config.json, sharded safetensors, tokenizer) for ``arch``;
    ``overrides`` replace config fields (head counts, vocabulary size...).

    MoE checkpoints hold one tensor per expert and projection (what ``save_pretrained``
    writes by default), or with ``fused_experts`` transformers' own stacked
    ``experts.gate_up_proj`` / ``experts.down_proj`` (``save_original_format=False``).
    Router weights are scaled up so each token's top-k experts are clearly chosen.
    """
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    cfg = {**TINY, **ARCHS[arch], **(overrides or {})}
    if arch == "qwen2":
        cfg["attention_bias"] = True
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF inits biases and norms trivially: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.mul_(25.0)
        for name, b in model.named_buffers():  # DeepSeek-V3's routing bias (zeros at init)
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.5)
    extra = {"save_original_format": False} if fused_experts else {}
    model.save_pretrained(path, safe_serialization=True, max_shard_size="100KB", **extra)
    write_tokenizer(path)
    return path


def hf_model(path: Path):
    """The HF model of a checkpoint in fp32; MoE experts in transformers' eager loop (the reference
    ``fused_moe`` follows), where the installed version has a choice."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    extra = {"experts_implementation": "eager"} if hasattr(config, "_experts_implementation") else {}
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra).eval()


def hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    model = hf_model(path)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def ingot_logits(engine, ids: list[int], prefill_len: int, chunk: int | None = None) -> torch.Tensor:
    """Logits at every position: prefill ``ids[:prefill_len]`` (in chunks), then decode one by one."""
    from ingot.runner.kv_pool import blocks_for
    from ingot.layers.attention import AttentionMetadata

    runner = engine.executor
    bs = engine.config.block_size
    blocks = list(range(1, blocks_for(len(ids), bs) + 1))
    dev = engine.executor.device
    table = torch.tensor([blocks], dtype=torch.int32, device=dev)
    out = []
    steps = []
    chunk = chunk or prefill_len
    for s in range(0, prefill_len, chunk):
        steps.append((s, min(s + chunk, prefill_len), True))
    steps += [(p, p + 1, False) for p in range(prefill_len, len(ids))]
    with torch.inference_mode():
        for start, end, prefill in steps:
            pos = torch.arange(start, end, device=dev)
            slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(start, end)], device=dev)
            meta = AttentionMetadata(
                is_prefill=prefill,
                slot_mapping=slots,
                block_tables=table,
                seq_lens=torch.tensor([end], dtype=torch.int32, device=dev),
                cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32, device=dev) if prefill else None,
            )
            hidden = runner.model(torch.tensor(ids[start:end], device=dev), pos, meta, runner.policy)
            out.append(runner.model.compute_logits(hidden, runner.policy))
    return torch.cat(out).float().cpu()


class OpNames(torch.utils._python_dispatch.TorchDispatchMode):
    """Collects the names (namespace.op) of the ops that run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(f"{func.namespace}.{func._opname}")
        return func(*args, **(kwargs or {}))


def watch_draft_steps(llm, propose_every: int = 3) -> dict[str, list[int]]:
    """Record the rows of every replay of the draft's three graph sets (``decode``: its drafting
    steps, ``first``: a round's first step with missing tokens, ``kv``: following a plain step),
    and let sequences propose only every ``propose_every``-th step (as when backoffs keep them
    from it), so the draft also follows plain steps. Returns the record, filled as ``llm`` runs."""
    draft = llm.engine.executor.draft
    rows: dict[str, list[int]] = {"decode": [], "first": [], "kv": []}
    for kind, graphs in (("decode", draft.graphs), ("first", draft.verify_graphs), ("kv", draft.kv_graphs)):
        replay = graphs.run
        graphs.run = lambda inputs, replay=replay, kind=kind: rows[kind].append(inputs.num_seqs) or replay(inputs)
    speculator, steps = llm.engine.spec, itertools.count()
    propose = speculator.propose
    speculator.propose = lambda running, active: propose(running, active and next(steps) % propose_every == 0)
    return rows
