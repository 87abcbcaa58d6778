"""The Llama decoder family: Llama 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm).

One implementation; the differences are flags on ModelConfig. The forward works
on flattened tokens [T] and never looks at batch structure: that lives in
AttentionMetadata, so the same code serves prefill, eager decode and graphs.
The mixture-of-experts models (``moe.py``) are this model with another MLP in
some or all layers: ``make_mlp`` picks each layer's MLP, and every MLP runs
from the layer's residual stream through ``norm_forward``.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ingot.layers.activation import SiluAndMul
from ingot.layers.attention import Attention, AttentionMetadata
from ingot.layers.embedding import Embedding, LMHead
from ingot.layers.linear import Linear, MergedLinear, norm_linear, silu_mul_linear
from ingot.layers.norm import RMSNorm
from ingot.layers.policy import DEFAULT_POLICY, OpPolicy
from ingot.layers.rotary import RotaryEmbedding
from ingot.loading.errors import CheckpointError
from ingot.loading.model_config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, (q_size, kv_size, kv_size), bias=cfg.qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size)
        # q/k norm per head (Qwen3) or over the whole projection (OLMoE)
        self.qk_norm_full_width = cfg.qk_norm_full_width
        q_width, k_width = (q_size, kv_size) if cfg.qk_norm_full_width else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.clip_qkv = cfg.clip_qkv
        self.rotary = rotary  # one table shared by every layer
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self.splits = (q_size, kv_size, kv_size)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata, policy: OpPolicy) -> torch.Tensor:
        """Attention output projected by o_proj, from this layer's qkv projection (the layer
        computes it, so the norm before it can fuse into the GEMM)."""
        t = qkv.shape[0]
        q, k, v = qkv.split(self.splits, dim=-1)
        if self.q_norm is not None and self.qk_norm_full_width:
            q, k = self.q_norm(q, None, policy), self.k_norm(k, None, policy)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_full_width:
            q, k = self.q_norm(q, None, policy), self.k_norm(k, None, policy)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        out = self.attn(positions, q, k, v, meta, self.rotary, policy)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim), policy)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, (intermediate_size,) * 2)
        self.down_proj = Linear(intermediate_size, hidden_size)
        self.act = SiluAndMul()

    def forward(self, gate_up: torch.Tensor, policy: OpPolicy) -> torch.Tensor:
        """The down projection of silu(gate) * up, from this layer's gate_up projection."""
        return silu_mul_linear(gate_up, self.act, self.down_proj, policy)

    def norm_forward(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, policy: OpPolicy
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp(norm(x + residual)), x + residual): the norm fused into gate_up where it pays."""
        gate_up, residual = norm_linear(x, residual, norm, self.gate_up_proj, policy)
        return self(gate_up, policy), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp  # anything with norm_forward(x, residual, norm, policy): LlamaMLP, moe.MoEBlock

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        policy: OpPolicy,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            qkv = self.self_attn.qkv_proj(self.input_layernorm(x, None, policy), policy)
        else:
            qkv, residual = norm_linear(x, residual, self.input_layernorm, self.self_attn.qkv_proj, policy)
        x = self.self_attn(positions, qkv, meta, policy)
        return self.mlp.norm_forward(x, residual, self.post_attention_layernorm, policy)


# HF checkpoint name -> (our module suffix, shard index) for fused projections
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary, self.make_mlp(cfg, i)) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, self.embed_tokens if cfg.tie_word_embeddings else None)

    def make_mlp(self, cfg: ModelConfig, index: int) -> nn.Module:
        """The MLP of decoder layer ``index`` (the MoE models override it)."""
        return LlamaMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, policy: OpPolicy = DEFAULT_POLICY
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of every input token."""
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta, policy)
        x, _ = self.norm(x, residual, policy)
        return x

    def compute_logits(self, hidden: torch.Tensor, policy: OpPolicy = DEFAULT_POLICY) -> torch.Tensor:
        return self.lm_head(hidden, policy)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    # HF checkpoint name -> (our module suffix, shard index) for fused projections
    FUSED = _FUSED

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters, one at a time (nothing is kept);
        every parameter must be filled."""
        filled: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            filled.update(self.load_tensor(name, tensor))
        missing = sorted(self.expected_keys() - filled)
        if missing:
            more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(f"checkpoint is missing weights: {', '.join(missing[:5])}{more}")

    def load_tensor(self, name: str, tensor: torch.Tensor) -> list[str]:
        """Copy one tensor (HF name without ``model.``) into place; returns the keys it filled."""
        owner, _, pname = name.rpartition(".")
        head, _, proj = owner.rpartition(".")
        index = 0
        if proj in self.FUSED:
            fused, index = self.FUSED[proj]
            owner = f"{head}.{fused}"
        try:
            module = self.get_submodule(owner)
            param = getattr(module, pname)
        except AttributeError:
            param = None
        if not isinstance(param, nn.Parameter):
            raise CheckpointError(f"checkpoint tensor {name!r} does not belong to {self.config.architecture}")
        if isinstance(module, MergedLinear):
            try:
                module.load_shard(pname, index, tensor)
            except ValueError as exc:
                raise CheckpointError(f"{name}: {exc}") from None
        elif tuple(param.shape) != tuple(tensor.shape):
            raise CheckpointError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
        else:
            param.data.copy_(tensor)
        return [f"{owner}.{pname}#{index}"]

    def expected_keys(self) -> set[str]:
        keys = set()
        for name, param in self.named_parameters():
            owner, _, pname = name.rpartition(".")
            module = self.get_submodule(owner)
            shards = len(module.shard_sizes) if isinstance(module, MergedLinear) else 1
            keys.update(f"{name}#{i}" for i in range(shards))
        return keys
