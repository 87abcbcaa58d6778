"""Gemma 2 and Gemma 3 (text): the Llama attention with another decoder block around it.

A Gemma block normalises four times (before and after the attention, before and after
the MLP) with Gemma's ``(1 + w)`` RMSNorm (``layers/norm.py``), and its MLP is GeGLU
(gelu, tanh approximation). The embedding is scaled by sqrt(hidden) in the model dtype;
the attention scale is ``query_pre_attn_scalar ** -0.5``; the embeddings are tied.
Gemma 2 alternates sliding-window and global layers and soft-caps the attention and the
final logits; Gemma 3 has five local layers to one global, a per-head q/k norm, and its
own rope base for local layers. All of it follows ModelConfig (``layer_windows``,
``attn_logit_softcap``, ``final_logit_softcap``, ``local_rope_theta``), so one class
serves both; the checkpoint names are Llama's plus the extra norms, so loading is
``LlamaForCausalLM``'s.
"""

from __future__ import annotations

import torch
from torch import nn

from ingot.distributed.parallel import SINGLE, TensorParallel
from ingot.layers.activation import gelu_tanh_and_mul
from ingot.layers.attention import AttentionMetadata
from ingot.layers.embedding import Embedding, LMHead
from ingot.layers.linear import Linear, MergedLinear
from ingot.layers.norm import GemmaRMSNorm
from ingot.layers.policy import DEFAULT_POLICY, OpPolicy
from ingot.layers.rotary import RotaryEmbedding
from ingot.loading.model_config import ModelConfig
from ingot.models.llama import LlamaAttention, LlamaForCausalLM


class GemmaAttention(LlamaAttention):
    """Llama's attention (its scale, window and soft-cap come from the config) with Gemma 3's
    per-head q/k norms, which round as Gemma's norm does, so they run here and not folded
    into the decode op."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel, index: int) -> None:
        super().__init__(cfg, rotary, tp, f"layers.{index}.self_attn", index)
        head_norms = cfg.architecture == "Gemma3ForCausalLM"
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps) if head_norms else None
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps) if head_norms else None

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata, policy: OpPolicy) -> torch.Tensor:
        t = qkv.shape[0]
        q, k, v = qkv.split(self.splits, dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.attn(positions, q, k, v, meta, self.rotary, policy).reshape(t, self.num_heads * self.head_dim)


class GemmaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, index: int) -> None:
        super().__init__()
        prefix = f"layers.{index}.mlp"
        self.gate_up_proj = MergedLinear(cfg.hidden_size, (cfg.intermediate_size,) * 2, tp=tp, split="column",
                                         scheme=cfg.linear_scheme(prefix, ("gate_proj", "up_proj")))
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, tp=tp, split="row",
                                scheme=cfg.linear_scheme(prefix, ("down_proj",)))

    def forward(self, x: torch.Tensor, policy: OpPolicy) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x, policy)), policy)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel, index: int) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = GemmaAttention(cfg, rotary, tp, index)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GemmaMLP(cfg, tp, index)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, policy: OpPolicy) -> torch.Tensor:
        """The residual stream after this layer (adds in the model dtype, as HF)."""
        attn = self.self_attn
        h = attn(positions, attn.qkv_proj(self.input_layernorm(x), policy), meta, policy)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x), policy)
        return x + self.post_feedforward_layernorm(h)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (text); weights load as Llama's."""

    def __init__(self, cfg: ModelConfig, max_position: int, tp: TensorParallel = SINGLE) -> None:
        nn.Module.__init__(self)  # Llama's modules are not built: Gemma's differ
        self.config = cfg
        self.tp = tp
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, tp)
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        local = rotary if cfg.local_rope_theta is None else RotaryEmbedding(cfg.head_dim, max_position, cfg.local_rope_theta)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, local if cfg.layer_window(i) else rotary, tp, i) for i in range(cfg.num_layers)
        )
        self.head_order = None  # full rotary: q/k rows load as stored
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, self.embed_tokens if cfg.tie_word_embeddings else None, tp)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, policy: OpPolicy = DEFAULT_POLICY
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        for layer in self.layers:
            x = layer(positions, x, meta, policy)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, policy: OpPolicy = DEFAULT_POLICY) -> torch.Tensor:
        """The logits, soft-capped here once (Gemma 2): everything downstream (sampling,
        logprobs, prompt logprobs) reads these."""
        logits = self.lm_head(hidden, policy)
        cap = self.config.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap > 0 else logits
