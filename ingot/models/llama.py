"""The Llama decoder family: Llama 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm).

One implementation; the differences are flags on ModelConfig. The forward works
on flattened tokens [T] and never looks at batch structure: that lives in
AttentionMetadata, so the same code serves prefill, eager decode and graphs.

Under tensor parallelism (``tp``) each rank holds ``num_heads / size`` query
heads and its KV heads (split, or replicated when there are fewer KV heads
than ranks), ``intermediate_size / size`` MLP features and a slice of the
vocabulary; ``tensor_parallel_error`` states what must divide.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from ingot.distributed.parallel import SINGLE, TensorParallel, shard_range
from ingot.layers.activation import SiluAndMul
from ingot.layers.attention import Attention, AttentionMetadata
from ingot.layers.embedding import Embedding, LMHead
from ingot.layers.linear import Linear, MergedLinear, norm_linear, silu_mul_linear
from ingot.layers.norm import RMSNorm
from ingot.layers.policy import DEFAULT_POLICY, OpPolicy
from ingot.layers.rotary import RotaryEmbedding
from ingot.loading.errors import CheckpointError
from ingot.loading.model_config import ModelConfig


def tensor_parallel_error(cfg: ModelConfig, size: int) -> Optional[str]:
    """Why ``cfg`` cannot be split over ``size`` ranks (None if it can). Query heads and the
    MLP's intermediate size must divide by ``size``; KV heads must divide by it or divide
    it (then they are replicated). The vocabulary is padded, so any size works."""
    if cfg.num_heads % size:
        return f"num_attention_heads={cfg.num_heads} is not divisible by tensor_parallel_size={size}"
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        return (f"num_key_value_heads={cfg.num_kv_heads} neither divides by nor divides tensor_parallel_size={size} "
                "(KV heads are split, or replicated when there are fewer than ranks)")
    if cfg.intermediate_size % size:
        return f"intermediate_size={cfg.intermediate_size} is not divisible by tensor_parallel_size={size}"
    return None


def local_heads(cfg: ModelConfig, tp: TensorParallel) -> tuple[int, int]:
    """(query heads, KV heads) one rank holds."""
    return cfg.num_heads // tp.size, shard_range(cfg.num_kv_heads, tp, replicate=True)[1]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.num_heads, self.num_kv_heads = local_heads(cfg, tp)
        q_size, kv_size = cfg.num_heads * self.head_dim, cfg.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, (q_size, kv_size, kv_size), bias=cfg.qkv_bias, tp=tp, split="column",
                                     units=self.head_dim)
        self.o_proj = Linear(q_size, cfg.hidden_size, tp=tp, split="row", units=self.head_dim)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary  # one table shared by every layer
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self.splits = self.qkv_proj.local_sizes

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata, policy: OpPolicy) -> torch.Tensor:
        """Attention output projected by o_proj, from this layer's qkv projection (the layer
        computes it, so the norm before it can fuse into the GEMM)."""
        t = qkv.shape[0]
        q, k, v = qkv.split(self.splits, dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q, None, policy), self.k_norm(k, None, policy)
        out = self.attn(positions, q, k, v, meta, self.rotary, policy)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim), policy)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(cfg.hidden_size, (cfg.intermediate_size,) * 2, tp=tp, split="column")
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, tp=tp, split="row")
        self.act = SiluAndMul()

    def forward(self, gate_up: torch.Tensor, policy: OpPolicy) -> torch.Tensor:
        """The down projection of silu(gate) * up, from this layer's gate_up projection."""
        return silu_mul_linear(gate_up, self.act, self.down_proj, policy)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rotary, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp)

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
        gate_up, residual = norm_linear(x, residual, self.post_attention_layernorm, self.mlp.gate_up_proj, policy)
        return self.mlp(gate_up, policy), residual


# HF checkpoint name -> (our module suffix, shard index) for fused projections
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    tensor_parallel_error = staticmethod(tensor_parallel_error)

    def __init__(self, cfg: ModelConfig, max_position: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, tp)
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        tied = self.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tied, tp)

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

    def _target(self, name: str) -> Optional[tuple[str, str, nn.Module, str, int]]:
        """(HF name without prefix, module path, module, parameter name, shard index) a checkpoint
        tensor goes to; None for tensors the model does not hold (rotary tables, a tied lm_head)."""
        name = name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return None
        owner, _, pname = name.rpartition(".")
        head, _, proj = owner.rpartition(".")
        index = 0
        if proj in _FUSED:
            fused, index = _FUSED[proj]
            owner = f"{head}.{fused}"
        try:
            module = self.get_submodule(owner)
            param = getattr(module, pname)
        except AttributeError:
            param = None
        if not isinstance(param, nn.Parameter):
            raise CheckpointError(f"checkpoint tensor {name!r} does not belong to {self.config.architecture}")
        return name, owner, module, pname, index

    def checkpoint_slice(self, name: str) -> Optional[tuple[slice, ...]]:
        """The part of checkpoint tensor ``name`` this rank reads (None: all of it); the loaders
        cut it out before a tensor reaches ``load_weights``."""
        target = self._target(name)
        if target is None:
            return None
        _, _, module, pname, index = target
        if isinstance(module, MergedLinear):
            return module.checkpoint_slice(pname, index)
        if isinstance(module, (Embedding, LMHead)):
            return module.shard.checkpoint_slice()
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (cut to ``checkpoint_slice``) into the (fused) parameters;
        every parameter must be filled."""
        filled: set[str] = set()
        for full_name, tensor in weights:
            target = self._target(full_name)
            if target is None:
                continue
            name, owner, module, pname, index = target
            param = getattr(module, pname)
            try:
                if isinstance(module, MergedLinear):
                    module.load_shard(pname, index, tensor)
                elif isinstance(module, (Embedding, LMHead)):
                    module.shard.load(param, tensor)
                elif tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
                else:
                    param.data.copy_(tensor)
            except ValueError as exc:
                raise CheckpointError(f"{name}: {exc}") from None
            filled.add(f"{owner}.{pname}#{index}")
        missing = sorted(self._expected_keys() - filled)
        if missing:
            more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(f"checkpoint is missing weights: {', '.join(missing[:5])}{more}")
    def _expected_keys(self) -> set[str]:
        keys = set()
        for name, param in self.named_parameters():
            owner, _, pname = name.rpartition(".")
            module = self.get_submodule(owner)
            shards = len(module.shard_sizes) if isinstance(module, MergedLinear) else 1
            keys.update(f"{name}#{i}" for i in range(shards))
        return keys
