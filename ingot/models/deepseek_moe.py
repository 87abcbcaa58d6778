"""DeepSeek-V2 / V3 mixture-of-experts block: grouped top-k routing, routed and shared experts.

The routing is PyTorch glue as in ``moe.py`` (compiled decode fuses it), written
as transformers computes it (``ModelConfig.routing``, ``loading/deepseek_config.py``):
router logits in fp32; V2 takes the softmax and its top-k, over every expert
(``greedy``) or over the ``topk_group`` groups with the best single score
(``group_limited_greedy``); V3 takes the sigmoid, adds the score-correction bias
for the choice only, keeps the ``topk_group`` groups whose two best biased scores
sum highest (``noaux_tc``), weighs the chosen experts by their unbiased scores and
may renormalise them. Both scale the weights by ``routed_scaling_factor`` and
hand them on in fp32, as transformers does. The routed experts are the fused op
(``layers/fused_moe.py``; quantized, as the other MoE models' are: ``moe.routed_experts``);
the shared experts, one MLP of ``n_shared_experts`` expert widths (quantized like any
MLP), add to every token unscaled. The router stays in the model dtype (the model names it
dense: ``DeepseekForCausalLM.DENSE_MODULES``).
"""

from __future__ import annotations

import torch
from torch import nn

from ingot.layers.linear import MergedLinear
from ingot.layers.norm import RMSNorm
from ingot.layers.policy import OpPolicy
from ingot.loading.deepseek_config import GroupedRouting
from ingot.loading.model_config import ModelConfig
from ingot.models.llama import LlamaMLP
from ingot.models.moe import routed_experts


class Router(nn.Module):
    """The router's weight [E, hidden] (checkpoint ``mlp.gate.weight``) and V3's score-correction
    bias (``mlp.gate.e_score_correction_bias``, fp32 as transformers keeps it)."""

    def __init__(self, num_experts: int, hidden_size: int, corrected: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
                                        if corrected else None)


def _group_mask(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int) -> torch.Tensor:
    """[T, E] bool: the experts of each token's ``topk_group`` best groups (by ``group_scores`` [T, G])."""
    groups = group_scores.shape[-1]
    chosen = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    return mask.unsqueeze(-1).expand(-1, groups, scores.shape[-1] // groups).reshape(scores.shape)


def grouped_topk(logits: torch.Tensor, routing: GroupedRouting, top_k: int,
                 bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]) from fp32 router logits [T, E], as transformers routes."""
    t, e = logits.shape
    g = routing.n_group
    if routing.scoring == "sigmoid":
        scores = logits.sigmoid()
        choice = scores if bias is None else scores + bias
        group_scores = choice.view(t, g, e // g).topk(2, dim=-1)[0].sum(dim=-1)
        choice = choice.masked_fill(~_group_mask(choice, group_scores, routing.topk_group), float("-inf"))
        ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if routing.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if routing.topk_method == "group_limited_greedy":
            group_scores = scores.view(t, g, e // g).max(dim=-1).values
            scores = scores.masked_fill(~_group_mask(scores, group_scores, routing.topk_group), 0.0)
        weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return weights * routing.routed_scaling_factor, ids


class DeepseekMoE(nn.Module):
    """Router, routed experts and shared experts of one sparse DeepSeek layer."""

    def __init__(self, cfg: ModelConfig, prefix: str = "") -> None:
        super().__init__()
        assert cfg.routing is not None
        self.routing = cfg.routing
        self.top_k = cfg.num_experts_per_tok
        self.gate = Router(cfg.num_experts, cfg.hidden_size, corrected=cfg.routing.scoring == "sigmoid")
        self.experts = routed_experts(cfg, prefix)
        shared = cfg.shared_expert_intermediate_size
        self.shared_experts = LlamaMLP(cfg.hidden_size, shared, cfg=cfg, prefix=f"{prefix}.shared_experts") if shared else None

    def forward(self, h: torch.Tensor, policy: OpPolicy) -> torch.Tensor:
        """The block's output for normed hidden states ``h`` [T, H]."""
        logits = torch.nn.functional.linear(h.float(), self.gate.weight.float())
        weights, ids = grouped_topk(logits, self.routing, self.top_k, self.gate.e_score_correction_bias)
        out = self.experts(h, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(self.shared_experts.gate_up_proj(h, policy), policy)
        return out

    def norm_forward(
        self, x: torch.Tensor, proj: MergedLinear, residual: torch.Tensor, norm: RMSNorm, policy: OpPolicy
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(block(norm(proj(x) + residual)), proj(x) + residual): the decoder layer's MLP protocol."""
        h, residual = norm(proj(x, policy), residual, policy)
        return self(h, policy), residual
