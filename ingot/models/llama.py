"""The Llama decoder family: Llama 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm),
Phi-3/4 (fused checkpoint projections, partial rotary, LongRoPE), SmolLM3 (layers
without rotary); OLMo 2 swaps the decoder layer (``olmo2.py``).

One implementation; the differences are flags on ModelConfig. The forward works
on flattened tokens [T] and never looks at batch structure: that lives in
AttentionMetadata, so the same code serves prefill, eager decode and graphs.
The mixture-of-experts models (``moe.py``) are this model with another MLP in
some or all layers: ``make_mlp`` picks each layer's MLP, and every MLP runs
from the layer's residual stream through ``norm_forward``, which also takes the
attention's output before its o_proj (a MoE layer's router rides in that GEMV).

Under tensor parallelism (``tp``) each rank holds ``num_heads / size`` query
heads and its KV heads (split, or replicated when there are fewer KV heads
than ranks), ``intermediate_size / size`` MLP features and a slice of the
vocabulary; ``tensor_parallel_error`` states what must divide.
"""

from __future__ import annotations

from typing import Iterable, Optional, Protocol

import torch
from torch import nn

from ingot.distributed.parallel import SINGLE, TensorParallel, shard_range
from ingot.layers.activation import SiluAndMul
from ingot.layers.attention import Attention, AttentionMetadata
from ingot.layers.embedding import Embedding, LMHead
from ingot.layers.linear import Linear, MergedLinear, act_mul_linear, norm_linear
from ingot.layers.norm import RMSNorm
from ingot.layers.policy import DEFAULT_POLICY, OpPolicy
from ingot.layers.rotary import RotaryEmbedding, partial_rotary_order
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
    if cfg.qk_norm and cfg.qk_norm_full_width:
        return "the q/k norm spans every head of the projection (OLMoE); it is not split over ranks"
    if cfg.intermediate_size % size:
        return f"intermediate_size={cfg.intermediate_size} is not divisible by tensor_parallel_size={size}"
    return None


def local_heads(cfg: ModelConfig, tp: TensorParallel) -> tuple[int, int]:
    """(query heads, KV heads) one rank holds."""
    return cfg.num_heads // tp.size, shard_range(cfg.num_kv_heads, tp, replicate=True)[1]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel = SINGLE, prefix: str = "",
                 index: int = 0) -> None:
        """``prefix``: the module's checkpoint name (``layers.N.self_attn``), which names the
        quantization of its projections; ``index``: the layer's, which picks its sliding window."""
        super().__init__()
        self.head_dim = cfg.head_dim
        self.num_heads, self.num_kv_heads = local_heads(cfg, tp)
        q_size, kv_size = cfg.num_heads * self.head_dim, cfg.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, (q_size, kv_size, kv_size), bias=cfg.qkv_bias, tp=tp, split="column",
                                     units=self.head_dim, scheme=cfg.linear_scheme(prefix, ("q_proj", "k_proj", "v_proj")))
        self.o_proj = Linear(q_size, cfg.hidden_size, cfg.o_bias, tp=tp, split="row", units=self.head_dim,
                             scheme=cfg.linear_scheme(prefix, ("o_proj",)))
        # gpt-oss: a learned logit per query head in the softmax's denominator (this rank's heads)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if cfg.attn_sinks else None
        # q/k norm per head (Qwen3) or over the whole projection (OLMoE; never split over ranks)
        self.qk_norm_full_width = cfg.qk_norm_full_width
        q_width, k_width = (q_size, kv_size) if cfg.qk_norm_full_width else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.clip_qkv = cfg.clip_qkv
        self.rotary = rotary  # one table shared by every layer
        scale = (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale, cfg.layer_window(index),
                              cfg.attn_logit_softcap)
        self.splits = self.qkv_proj.local_sizes

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata, policy: OpPolicy) -> torch.Tensor:
        """Attention output projected by o_proj."""
        return self.o_proj(self.attend(positions, qkv, meta, policy), policy)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata, policy: OpPolicy) -> torch.Tensor:
        """Attention output [T, heads * head_dim] before o_proj, from this layer's qkv projection
        (the layer computes it, so the norm before it can fuse into the GEMM)."""
        t = qkv.shape[0]
        q, k, v = qkv.split(self.splits, dim=-1)
        if self.q_norm is not None and self.qk_norm_full_width:
            q, k = self.q_norm(q, None, policy), self.k_norm(k, None, policy)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        head_norms = None
        if self.q_norm is not None and not self.qk_norm_full_width:
            if self.clip_qkv is None:
                head_norms = (self.q_norm, self.k_norm)  # the attention applies them (folded into decode)
            else:
                q, k = self.q_norm(q, None, policy), self.k_norm(k, None, policy)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        out = self.attn(positions, q, k, v, meta, self.rotary, policy, head_norms, self.sinks)
        return out.reshape(t, self.num_heads * self.head_dim)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel = SINGLE, reduce: bool = True,
                 cfg: Optional[ModelConfig] = None, prefix: str = "") -> None:
        """``reduce=False``: the down projection's partial sums stay unreduced (a caller that
        adds this MLP to other row-parallel outputs all-reduces the sum once). ``cfg`` and
        ``prefix`` (``layers.N.mlp``) name the quantization of its projections."""
        super().__init__()
        gate_up = cfg.linear_scheme(prefix, ("gate_proj", "up_proj")) if cfg is not None else None
        down = cfg.linear_scheme(prefix, ("down_proj",)) if cfg is not None else None
        self.gate_up_proj = MergedLinear(hidden_size, (intermediate_size,) * 2, tp=tp, split="column", scheme=gate_up)
        self.down_proj = Linear(intermediate_size, hidden_size, tp=tp, split="row", reduce=reduce, scheme=down)
        self.act = SiluAndMul()

    def forward(self, gate_up: torch.Tensor, policy: OpPolicy) -> torch.Tensor:
        """The down projection of silu(gate) * up, from this layer's gate_up projection."""
        return act_mul_linear(gate_up, self.act, self.down_proj, policy)

    def norm_forward(
        self, x: torch.Tensor, proj: MergedLinear, residual: torch.Tensor, norm: RMSNorm, policy: OpPolicy
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp(norm(proj(x) + residual)), proj(x) + residual): the decoder layer's MLP protocol
        (``proj`` is the attention's o_proj); the norm fused into gate_up where it pays."""
        gate_up, residual = norm_linear(proj(x, policy), residual, norm, self.gate_up_proj, policy)
        return self(gate_up, policy), residual


class LlamaDecoderLayer(nn.Module):
    # anything with qkv_proj, o_proj and attend(positions, qkv, meta, policy) (DeepSeek's latent attention)
    attention_type: type[nn.Module] = LlamaAttention

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, mlp: nn.Module, tp: TensorParallel = SINGLE,
                 index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_type(cfg, rotary, tp, f"layers.{index}.self_attn", index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp  # anything with norm_forward(x, proj, residual, norm, policy): LlamaMLP, moe.MoEBlock

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
        x = self.self_attn.attend(positions, qkv, meta, policy)
        return self.mlp.norm_forward(x, self.self_attn.o_proj, residual, self.post_attention_layernorm, policy)


# HF checkpoint name -> (our module suffix, shard index) for fused projections
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class HiddenSink(Protocol):
    """Where the forward leaves hidden states for a proposer that reads them (an EAGLE head,
    ``models/eagle.py``): the residual stream entering each of ``layers``, or with none the
    final normed states, one row per token at its KV slot."""

    layers: tuple[int, ...]

    def store(self, states: list[torch.Tensor], slots: torch.Tensor, policy: OpPolicy) -> None: ...


class LlamaForCausalLM(nn.Module):
    tensor_parallel_error = staticmethod(tensor_parallel_error)
    decoder_layer: type[nn.Module] = LlamaDecoderLayer
    hidden_sink: Optional[HiddenSink] = None  # set (as a plain attribute) while an EAGLE head drafts

    def __init__(self, cfg: ModelConfig, max_position: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, tp)
        rotary = self.make_rotary(cfg, max_position)
        unrotated = RotaryEmbedding.identity(cfg.head_dim, max_position) if cfg.nope_layers else None
        self.layers = nn.ModuleList(
            self.decoder_layer(cfg, unrotated if i in cfg.nope_layers else rotary, self.make_mlp(cfg, i), tp, i)
            for i in range(cfg.num_layers))
        # partial rotary: each head's q/k dims reordered at load (``partial_rotary_order``)
        self.head_order = (partial_rotary_order(cfg.head_dim, cfg.rotary_dim) if cfg.rotary_dim < cfg.head_dim
                           else None)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        tied = self.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tied, tp)

    def make_rotary(self, cfg: ModelConfig, max_position: int) -> RotaryEmbedding:
        """The rotary table every layer shares (DeepSeek's spans only the rope dims of a head)."""
        return RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim)

    def make_mlp(self, cfg: ModelConfig, index: int) -> nn.Module:
        """The MLP of decoder layer ``index`` (the MoE models override it)."""
        return LlamaMLP(cfg.hidden_size, cfg.intermediate_size, self.tp, cfg=cfg, prefix=f"layers.{index}.mlp")

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, policy: OpPolicy = DEFAULT_POLICY
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of every input token."""
        x = self.embed(input_ids)
        residual = None
        sink, kept = self.hidden_sink, []
        for i, layer in enumerate(self.layers):
            if sink is not None and i in sink.layers:
                kept.append(x if residual is None else x + residual)
            x, residual = layer(positions, x, residual, meta, policy)
        x, _ = self.norm(x, residual, policy)
        if sink is not None:
            sink.store(kept or [x], meta.slot_mapping, policy)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of ``input_ids`` (Gemma scales them)."""
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor, policy: OpPolicy = DEFAULT_POLICY) -> torch.Tensor:
        return self.lm_head(hidden, policy)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    # HF checkpoint name -> (our module suffix, shard index) for fused projections
    FUSED = _FUSED
    # checkpoint tensors that stack every shard of the projection of that name (Phi-3's)
    STACKED = ("qkv_proj", "gate_up_proj")
    # linear modules (QuantConfig.ignore's patterns) held in the model dtype whatever the checkpoint
    # stores: the loader hands them over dense (``loader.held_dense``)
    DENSE_MODULES: tuple[str, ...] = ()

    def _skipped(self, name: str) -> bool:
        """Checkpoint tensors (HF name without ``model.``) the model does not hold."""
        return "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (cut to ``checkpoint_slice``) into the (fused) parameters, one
        at a time (nothing is kept); every parameter must be filled."""
        filled: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if self._skipped(name):
                continue
            filled.update(self.load_tensor(name, tensor))
        missing = sorted(self.expected_keys() - filled)
        if missing:
            more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(f"checkpoint is missing weights: {', '.join(missing[:5])}{more}")

    def checkpoint_slice(self, name: str) -> Optional[tuple[slice, ...]]:
        """The part of checkpoint tensor ``name`` this rank reads (None: all of it); the loaders
        cut it out before the tensor reaches ``load_weights``."""
        name = name.removeprefix("model.")
        return None if self._skipped(name) else self.tensor_slice(name)

    def tensor_slice(self, name: str) -> Optional[tuple[slice, ...]]:
        """``checkpoint_slice`` of one tensor (HF name without ``model.``; the MoE models override it)."""
        _, module, pname, index = self._target(name)
        if isinstance(module, MergedLinear):
            return None if index is None else module.checkpoint_slice(pname, index)
        if isinstance(module, (Embedding, LMHead)):
            return module.shard.checkpoint_slice()
        return None

    def _target(self, name: str) -> tuple[str, nn.Module, str, Optional[int]]:
        """(module path, module, parameter name, shard index) of a tensor (HF name without ``model.``);
        index None: the tensor stacks every shard of a merged projection (Phi-3's ``qkv_proj``)."""
        owner, _, pname = name.rpartition(".")
        head, _, proj = owner.rpartition(".")
        index: Optional[int] = 0
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
        if proj in self.STACKED and isinstance(module, MergedLinear):
            index = None
        return owner, module, pname, index

    def load_tensor(self, name: str, tensor: torch.Tensor) -> list[str]:
        """Copy one tensor (HF name without ``model.``) into place; returns the keys it filled."""
        owner, module, pname, index = self._target(name)
        param = getattr(module, pname)
        try:
            if isinstance(module, MergedLinear) and index is None:
                for i, part in enumerate(module.split_stacked(pname, tensor)):
                    module.load_shard(pname, i, self._head_layout(owner, i, pname, part))
                return [f"{owner}.{pname}#{i}" for i in range(len(module.shard_sizes))]
            tensor = self._head_layout(owner, index, pname, tensor)
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
        return [f"{owner}.{pname}#{index}"]

    def _head_layout(self, owner: str, index: int, pname: str, tensor: torch.Tensor) -> torch.Tensor:
        """Under partial rotary, the q and k rows (and q/k norm weights) of each head in the order
        the rotary table expects (``head_order``); any other tensor as it is."""
        order = self.head_order
        is_qk = owner.endswith("self_attn.qkv_proj") and index in (0, 1)
        if order is None or not (is_qk or owner.endswith(("self_attn.q_norm", "self_attn.k_norm"))):
            return tensor
        if is_qk and getattr(self.get_submodule(owner), "scheme", None) is not None and pname != "bias":
            raise ValueError("partial rotary reorders the q/k rows of each head: quantized q/k projections "
                             "are not supported")
        heads = tensor.reshape(-1, order.numel(), *tensor.shape[1:])
        return heads[:, order.to(tensor.device)].reshape(tensor.shape)

    def expected_keys(self) -> set[str]:
        keys = set()
        for name, param in self.named_parameters():
            owner, _, pname = name.rpartition(".")
            module = self.get_submodule(owner)
            shards = len(module.shard_sizes) if isinstance(module, MergedLinear) else 1
            keys.update(f"{name}#{i}" for i in range(shards))
        return keys
