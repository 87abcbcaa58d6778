"""The DeepSeek-V2 / V3 fields of ModelConfig: multi-head latent attention and grouped routing.

Kept apart from ``model_config.py`` because only these two architectures read
them. The rules follow transformers' modeling code (the ground truth ingot's
tests compare with): V2 scores experts with a softmax and picks them greedily or
within the best groups (``topk_method``); V3 scores with a sigmoid, picks groups
by the sum of their two best biased scores (``e_score_correction_bias``) and may
renormalise (``norm_topk_prob``); both scale the weights by
``routed_scaling_factor``. transformers ignores V2's ``norm_topk_prob`` and V3's
``topk_method`` / ``scoring_func``; so does ingot. Sparse layers follow
DeepSeek's rule (``first_k_dense_replace``, ``moe_layer_freq``), which is
transformers' for every released checkpoint (``moe_layer_freq`` 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ingot.loading.errors import CheckpointError

DEEPSEEK_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_V2_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention: queries (optionally through a rank-``q_lora_rank`` bottleneck),
    one shared latent of ``kv_lora_rank`` values and one rope'd key of ``qk_rope_head_dim`` per token."""

    kv_lora_rank: int
    q_lora_rank: Optional[int]
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # checkpoint q/k rope dims in pairs (x0, x1), (x2, x3)...: reordered at load

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values cached per token and layer: the normed latent, then the rope'd key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class GroupedRouting:
    """How a DeepSeek MoE layer picks and weighs its experts."""

    scoring: str  # "softmax" (V2) or "sigmoid" with a score-correction bias (V3)
    topk_method: str  # "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3)
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    moe_layer_freq: int

    def is_sparse(self, index: int) -> bool:
        return index >= self.first_k_dense_replace and index % self.moe_layer_freq == 0


def _int(cfg: dict[str, Any], key: str, default: Optional[int] = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise CheckpointError(f"config.json of a DeepSeek model is missing {key!r}")
    return int(value)


def deepseek_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a DeepSeek-V2 / V3 config ({} for other architectures); CheckpointError
    naming the field for settings ingot does not run."""
    if arch not in DEEPSEEK_ARCHS:
        return {}
    v3 = arch == "DeepseekV3ForCausalLM"
    q_lora = cfg.get("q_lora_rank")
    mla = MLAConfig(
        kv_lora_rank=_int(cfg, "kv_lora_rank"),
        q_lora_rank=int(q_lora) if q_lora else None,
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim"),
        qk_rope_head_dim=_int(cfg, "qk_rope_head_dim"),
        v_head_dim=_int(cfg, "v_head_dim"),
        rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,  # V2 always rotates pairs
    )
    if mla.qk_rope_head_dim % 2:
        raise CheckpointError(f"qk_rope_head_dim={mla.qk_rope_head_dim} must be even")
    if cfg.get("mlp_bias"):
        raise CheckpointError("mlp_bias=True is not supported for DeepSeek models")
    if str(cfg.get("hidden_act", "silu")) != "silu":
        raise CheckpointError(f"hidden_act={cfg.get('hidden_act')!r} is not supported (DeepSeek MLPs run SiLU)")
    heads = _int(cfg, "num_attention_heads")
    fields: dict[str, Any] = dict(mla=mla, head_dim=mla.qk_head_dim, num_kv_heads=heads)
    experts = int(cfg.get("n_routed_experts") or 0)
    if not experts:
        return fields
    top_k = _int(cfg, "num_experts_per_tok")
    if not 0 < top_k <= experts:
        raise CheckpointError(f"num_experts_per_tok={top_k} must be in [1, n_routed_experts={experts}]")
    method = "noaux_tc" if v3 else str(cfg.get("topk_method") or "greedy")
    if not v3 and method not in _V2_METHODS:
        raise CheckpointError(f"topk_method={method!r} is not supported for DeepSeek-V2 (supported: {', '.join(_V2_METHODS)})")
    groups, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if method != "greedy":
        if experts % groups:
            raise CheckpointError(f"n_group={groups} does not divide n_routed_experts={experts}")
        if not 0 < topk_group <= groups:
            raise CheckpointError(f"topk_group={topk_group} must be in [1, n_group={groups}]")
        if top_k > topk_group * (experts // groups):
            raise CheckpointError(f"num_experts_per_tok={top_k} exceeds the experts of topk_group={topk_group} groups")
    if v3 and experts // groups < 2:
        raise CheckpointError(f"n_group={groups} leaves fewer than two experts per group (V3 scores a group by its best two)")
    freq = int(cfg.get("moe_layer_freq") or 1)
    routing = GroupedRouting(
        scoring="sigmoid" if v3 else "softmax",
        topk_method=method,
        n_group=groups,
        topk_group=topk_group,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) if v3 else False,
        first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
        moe_layer_freq=freq,
    )
    width = _int(cfg, "moe_intermediate_size")
    return dict(
        fields,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        shared_expert_intermediate_size=width * int(cfg.get("n_shared_experts") or 0),
        norm_topk_prob=routing.norm_topk_prob,
        routing=routing,
    )
