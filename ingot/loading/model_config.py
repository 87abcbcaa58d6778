"""ModelConfig: the architecture facts ingot needs, read from an HF config.json dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ingot.loading.errors import CheckpointError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: Optional[dict[str, Any]] = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: Optional[int] = None
    torch_dtype: Optional[torch.dtype] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if not archs:
            raise CheckpointError("config.json has no 'architectures' entry")
        arch = archs[0]
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            inter = int(cfg["intermediate_size"])
            vocab = int(cfg["vocab_size"])
        except KeyError as exc:
            raise CheckpointError(f"config.json is missing {exc.args[0]!r}") from None
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise CheckpointError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        # transformers >= 5 keeps rope settings in `rope_parameters`
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = cfg.get("eos_token_id")
        dtype_name = cfg.get("torch_dtype") or cfg.get("dtype")
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)) or arch == "Qwen2ForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=int(sliding) if sliding else None,
            torch_dtype=_DTYPES.get(str(dtype_name)) if dtype_name else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        )
