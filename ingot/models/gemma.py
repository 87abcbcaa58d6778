"""Gemma 2 and Gemma 3 (text): the Llama attention with another decoder block around it.

A Gemma block normalises four times (before and after the attention, before and after
the MLP) with Gemma's ``(1 + w)`` RMSNorm, and its MLP is GeGLU (gelu, tanh
approximation). The embedding is scaled by sqrt(hidden) in the model dtype; the
attention scale is ``query_pre_attn_scalar ** -0.5``; the embeddings are tied.
Gemma 2 alternates sliding-window and global layers and soft-caps the attention and the
final logits; Gemma 3 has five local layers to one global, a per-head q/k norm (Qwen3's,
``ModelConfig.qk_norm``, folded into the decode attention), and its own rope base for
local layers. All of it follows ModelConfig (``layer_windows``, ``attn_logit_softcap``,
``final_logit_softcap``, ``local_rope_theta``), so one class serves both; the checkpoint
names are Llama's plus the extra norms, so loading is ``LlamaForCausalLM``'s.

The norms are Llama's ``RMSNorm`` with ``1 + w`` folded into the weight at load
(``load_tensor``), so they run through the same ops and fused prologues (``norm_linear``:
add + norm + GEMV in one launch at decode). HF computes ``(x_fp32 * rstd) * (1 + w.float())``
and casts once; the ops compute ``(1 + w) * (x_fp32 * rstd).to(dtype)``. In fp32 that is the
same product, bit for bit; in bf16 the folded weight ``1 + w`` is rounded to bf16 once at
load, and the normed row is rounded before the weight multiplies it (one more rounding
each, as Llama's norm rounds), a difference at the level of bf16 rounding.

The layers keep Llama's ``(x, residual)`` protocol, the stream being their sum: a layer
returns its post-feedforward-normed MLP output as ``x``, which the next layer's input norm
adds to the residual (``add_rms_norm``, fused into its qkv GEMV); the post-attention norm's
output is added the same way by the pre-feedforward norm.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ingot.distributed.parallel import SINGLE, TensorParallel
from ingot.layers.activation import GeluTanhAndMul
from ingot.layers.attention import AttentionMetadata
from ingot.layers.embedding import Embedding, LMHead
from ingot.layers.linear import norm_linear
from ingot.layers.norm import RMSNorm
from ingot.layers.policy import DEFAULT_POLICY, OpPolicy
from ingot.layers.rotary import RotaryEmbedding
from ingot.loading.model_config import ModelConfig
from ingot.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class GemmaMLP(LlamaMLP):
    """Llama's MLP with GeGLU in place of SiLU (fused into the down projection's GEMV at decode)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, index: int) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size, tp, cfg=cfg, prefix=f"layers.{index}.mlp")
        self.act = GeluTanhAndMul()


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel, index: int) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = LlamaAttention(cfg, rotary, tp, f"layers.{index}.self_attn", index)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.mlp = GemmaMLP(cfg, tp, index)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: Optional[torch.Tensor],
        meta: AttentionMetadata,
        policy: OpPolicy,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(post_ff_norm(mlp(h)), h) with h = stream + post_attn_norm(attn(input_norm(stream))),
        stream = x + residual (the adds in the model dtype, as HF)."""
        attn = self.self_attn
        if residual is None:
            residual = x
            qkv = attn.qkv_proj(self.input_layernorm(x, None, policy), policy)
        else:
            qkv, residual = norm_linear(x, residual, self.input_layernorm, attn.qkv_proj, policy)
        h = self.post_attention_layernorm(attn(positions, qkv, meta, policy), None, policy)
        gate_up, residual = norm_linear(h, residual, self.pre_feedforward_layernorm, self.mlp.gate_up_proj, policy)
        return self.post_feedforward_layernorm(self.mlp(gate_up, policy), None, policy), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (text); weights load as Llama's, norms folded."""

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
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, self.embed_tokens if cfg.tie_word_embeddings else None, tp)

    def load_tensor(self, name: str, tensor: torch.Tensor) -> list[str]:
        """Llama's, with every norm's checkpoint ``w`` (zero-centred) stored as ``1 + w``: the sum
        in fp32, rounded to the model dtype once by the copy."""
        if isinstance(self._target(name)[1], RMSNorm):
            tensor = 1.0 + tensor.float()
        return super().load_tensor(name, tensor)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings times sqrt(hidden), the factor rounded to the model dtype first (HF's)."""
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)

    def compute_logits(self, hidden: torch.Tensor, policy: OpPolicy = DEFAULT_POLICY) -> torch.Tensor:
        """The logits, soft-capped here once (Gemma 2): everything downstream (sampling,
        logprobs, prompt logprobs) reads these."""
        logits = self.lm_head(hidden, policy)
        cap = self.config.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap > 0 else logits
