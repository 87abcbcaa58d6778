"""OLMo 2: the Llama family with each sublayer's output normed before its residual add.

HF's ``Olmo2DecoderLayer`` has no pre-norm: ``h = x + norm_a(attn(x))``, then
``h + norm_f(mlp(h))``. The layer keeps the model's (x, residual) protocol (the
stream is their sum), so the final norm and every other piece of
``LlamaForCausalLM`` apply as they are; the q/k norm over the whole projection
is OLMoE's (``ModelConfig.qk_norm_full_width``).
"""

from __future__ import annotations

import torch
from torch import nn

from ingot.distributed.parallel import SINGLE, TensorParallel
from ingot.layers.attention import AttentionMetadata
from ingot.layers.norm import RMSNorm
from ingot.layers.policy import OpPolicy
from ingot.layers.rotary import RotaryEmbedding
from ingot.loading.model_config import ModelConfig
from ingot.models.llama import LlamaAttention, LlamaForCausalLM


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, mlp: nn.Module, tp: TensorParallel = SINGLE,
                 index: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, tp, f"layers.{index}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp  # a LlamaMLP: OLMo 2 is dense
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        policy: OpPolicy,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm_f(mlp(h)), h) with h = stream + norm_a(attn(stream)), stream = x + residual."""
        stream = x if residual is None else x + residual
        attn = self.self_attn(positions, self.self_attn.qkv_proj(stream, policy), meta, policy)
        h = stream + self.post_attention_layernorm(attn, None, policy)
        out = self.mlp(self.mlp.gate_up_proj(h, policy), policy)
        return self.post_feedforward_layernorm(out, None, policy), h


class Olmo2ForCausalLM(LlamaForCausalLM):
    decoder_layer = Olmo2DecoderLayer
