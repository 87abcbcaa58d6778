"""The GEMM-only floor covers exactly the model's projections."""

from __future__ import annotations

import torch

from ingot.bench.gemm_floor import gemm_only_ms, linear_weights
from ingot.layers.policy import OpPolicy
from ingot.models.loader import build_model, init_random
from ingot.loading.model_config import ModelConfig
from tests.helpers import ARCHS, TINY


def test_linear_weights_are_every_projection_once():
    cfg = ModelConfig.from_hf({**TINY, **ARCHS["qwen2"], "attention_bias": True})
    model = init_random(build_model(cfg, torch.float32, torch.device("cpu"), 64))
    weights = linear_weights(model)
    assert len(weights) == 4 * cfg.num_layers + 1  # qkv, o, gate_up, down per layer + lm_head
    macs = sum(w.numel() for w, _ in weights)
    h, i, q, kv, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.vocab_size
    per_layer = h * (q + 2 * kv) + q * h + h * 2 * i + i * h
    assert macs == cfg.num_layers * per_layer + v * h
    assert weights[0][1] is not None  # qkv bias kept


def test_gemm_only_ms_runs_on_cpu():
    cfg = ModelConfig.from_hf({**TINY, **ARCHS["llama"]})
    model = init_random(build_model(cfg, torch.float32, torch.device("cpu"), 64))
    assert gemm_only_ms(model, batch=2, policy=OpPolicy(), iters=3) > 0
