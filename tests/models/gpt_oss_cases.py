"""Tiny random gpt-oss checkpoints written by HF transformers (fp32), shared by the gpt-oss tests."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers import TINY, write_tokenizer

GPT_OSS = dict(
    TINY, num_hidden_layers=3, head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
    sliding_window=8, swiglu_limit=0.6, initializer_range=0.1, attention_bias=True,
    # YaRN over a short original context, so its ramp and attention factor matter here
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 32},
)


def gpt_oss_model(seed: int = 0, **overrides):
    """A random HF GptOssForCausalLM (fp32) whose biases, norms and sinks matter."""
    import transformers

    fields = {k: v for k, v in {**GPT_OSS, **overrides}.items() if k != "rope_theta"}
    config = transformers.GptOssConfig(**fields)
    config.architectures = ["GptOssForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("sinks"):
                p.copy_(torch.randn_like(p))  # about as large as the logits: the denominator changes
            if name.endswith("router.weight"):
                p.mul_(5.0)  # each token's top-k experts clearly chosen
    return model


def write_gpt_oss(path: Path, seed: int = 0, **overrides) -> Path:
    model = gpt_oss_model(seed, **overrides)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path
