"""DeepSeek-V2 / V3: multi-head latent attention (MLA) over a compressed KV cache, and MoE.

The decoder is the Llama family's (``llama.py``: norms, residual stream, weight
loading) with two parts swapped: ``MLAttention`` for the attention and
``deepseek_moe.DeepseekMoE`` for the MLP of sparse layers (the first
``first_k_dense_replace`` layers keep a dense MLP).

Attention. One GEMM (``qkv_proj``) computes the query (``q_proj``, or V3's /
V2's low-rank ``q_a_proj`` then ``q_a_layernorm`` and ``q_b_proj``) and
``kv_a_proj_with_mqa``: a latent of ``kv_lora_rank`` values and one key of
``qk_rope_head_dim`` shared by every head. The cache keeps per token only the
normed latent and the rope'd key (``ModelConfig.kv_cache_entry``: 576 values for
V2-Lite, one tensor per layer, no separate V). Attention runs absorbed, for
prefill and decode alike: each head's no-rope query goes through its slice of
``kv_b_proj`` (W_UK) into the latent space, the op attends over the cached
entries as multi-query attention (``ops/reference_mla.py``), and the weighted
latents go through W_UV before ``o_proj``. Prefill and decode read every context
token from the cache (the step's entries are stored first, in a launch of their
own), so chunked prefill, prefix-cache hits and a verify step's rows of one
sequence (``AttentionMetadata.store_first``) need nothing more.

Rope. DeepSeek rotates dims in pairs ``(2i, 2i + 1)`` (V2 always; V3 with
``rope_interleave``): the rope rows of q and k are reordered at load
(``rotary.interleaved_rope_order``) so ingot's neox-style rotary applies. The
softmax scale carries YaRN's ``mscale_all_dim`` correction squared, as in HF.

Quantized checkpoints. ``qkv_proj`` (its two shards in one scheme), ``q_b_proj``,
``o_proj``, the dense layers' MLPs, the shared experts and the routed experts are held
in the checkpoint's scheme, as in the other families. ``kv_b_proj`` is held in the model
dtype (its weight is W_UK and W_UV, read by the absorbed attention) and so is the router:
the model names them (``DENSE_MODULES``) and the loader hands them over dequantized
(``models.loader.held_dense``). The rope rows' reorder applies to a quantized
projection's parts alike (their rows are its outputs); fp8 block scales stay as they are,
every rope row staying in its block (refused otherwise).

Not supported: tensor parallelism, ``attention_bias``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ingot.distributed.parallel import SINGLE, TensorParallel
from ingot.layers.attention import AttentionMetadata
from ingot.layers.linear import Linear, MergedLinear
from ingot.layers.norm import RMSNorm
from ingot.layers.policy import OpPolicy
from ingot.layers.rotary import RotaryEmbedding, interleaved_rope_order, yarn_softmax_scale
from ingot.loading.errors import CheckpointError
from ingot.loading.quant_scheme import Fp8Weights
from ingot.loading.model_config import ModelConfig
from ingot.models.deepseek_moe import DeepseekMoE
from ingot.models.llama import LlamaDecoderLayer, LlamaMLP
from ingot.models.moe import MoEForCausalLM

# transformers' RMSNorm default: the latent norms of DeepSeek's attention ignore rms_norm_eps
_LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """Multi-head latent attention of one layer; holds its cache (``k_cache``, set by the runner)."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel = SINGLE, prefix: str = "",
                 index: int = 0) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        self.num_heads = cfg.num_heads
        self.nope, self.rope, self.v_dim, self.rank = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim, mla.kv_lora_rank
        q_width = self.num_heads * mla.qk_head_dim
        query = "q_a_proj" if mla.q_lora_rank else "q_proj"
        self.qkv_proj = MergedLinear(cfg.hidden_size, (mla.q_lora_rank or q_width, mla.cache_dim),
                                     scheme=cfg.linear_scheme(prefix, (query, "kv_a_proj_with_mqa")))
        self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS) if mla.q_lora_rank else None
        self.q_b_proj = (Linear(mla.q_lora_rank, q_width, scheme=cfg.linear_scheme(prefix, ("q_b_proj",)))
                         if mla.q_lora_rank else None)
        self.kv_a_layernorm = RMSNorm(self.rank, _LATENT_NORM_EPS)
        if cfg.linear_scheme(prefix, ("kv_b_proj",)) is not None:
            raise CheckpointError(f"{prefix}.kv_b_proj: the latent attention reads its weight dense; open the checkpoint "
                                  "with models.loader.held_dense (DeepseekForCausalLM.DENSE_MODULES), which dequantizes it")
        self.kv_b_proj = Linear(self.rank, self.num_heads * (self.nope + self.v_dim))
        self.o_proj = Linear(self.num_heads * self.v_dim, cfg.hidden_size, scheme=cfg.linear_scheme(prefix, ("o_proj",)))
        self.rotary = rotary
        self.scale = yarn_softmax_scale(mla.qk_head_dim**-0.5, cfg.rope_scaling)
        self.splits = self.qkv_proj.local_sizes
        self.k_cache: Optional[torch.Tensor] = None  # [blocks, block_size, 1, kv_lora_rank + rope dims]
        self.v_cache: Optional[torch.Tensor] = None  # always None: the latent is the value

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata, policy: OpPolicy) -> torch.Tensor:
        """Attention output [T, heads * v_head_dim] before o_proj, from this layer's fused input projection."""
        assert self.k_cache is not None, "KV cache not bound: ModelRunner allocates it"
        t, h = qkv.shape[0], self.num_heads
        q, kv = qkv.split(self.splits, dim=-1)
        if self.q_b_proj is not None:
            q = self.q_b_proj(self.q_a_layernorm(q.contiguous(), None, policy), policy)
        q_nope, q_pe = q.view(t, h, self.nope + self.rope).split((self.nope, self.rope), dim=-1)
        latent = self.kv_a_layernorm(kv[:, : self.rank].contiguous(), None, policy)
        q_pe, k_pe = self.rotary(positions, q_pe.contiguous(), kv[:, self.rank :].reshape(t, 1, self.rope).contiguous(), policy)
        torch.ops.ingot.mla_store_kv(latent, k_pe.view(t, self.rope), self.k_cache, meta.slot_mapping)
        w = self.kv_b_proj.weight.view(h, self.nope + self.v_dim, self.rank)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w[:, : self.nope]).transpose(0, 1).contiguous()  # W_UK
        if meta.is_prefill:
            out = torch.ops.ingot.mla_prefill_attention(q_latent, q_pe, self.k_cache, meta.cu_seqlens_q, meta.seq_lens,
                                                        meta.block_tables, self.scale)
        else:
            out = torch.ops.ingot.mla_decode_attention(q_latent, q_pe, self.k_cache, meta.block_tables, meta.seq_lens,
                                                       self.scale)
        out = torch.bmm(out.transpose(0, 1), w[:, self.nope :].transpose(1, 2))  # W_UV: [H, T, v_head_dim]
        return out.transpose(0, 1).reshape(t, h * self.v_dim)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata, policy: OpPolicy) -> torch.Tensor:
        return self.o_proj(self.attend(positions, qkv, meta, policy), policy)


class DeepseekDecoderLayer(LlamaDecoderLayer):
    attention_type = MLAttention


def deepseek_tensor_parallel_error(cfg: ModelConfig, size: int) -> Optional[str]:
    """Always a reason: ingot runs DeepSeek's latent attention and routing on one device."""
    return "multi-head latent attention is not split over ranks (DeepSeek models run with tensor_parallel_size=1)"


class DeepseekForCausalLM(MoEForCausalLM):
    FUSED = {**MoEForCausalLM.FUSED, "q_a_proj": ("qkv_proj", 0), "kv_a_proj_with_mqa": ("qkv_proj", 1)}
    # kv_b_proj: W_UK / W_UV of the absorbed attention (``MLAttention.attend`` reads the weight); the router
    DENSE_MODULES = ("self_attn.kv_b_proj", "mlp.gate")
    decoder_layer = DeepseekDecoderLayer
    expert_blocks = (DeepseekMoE,)
    tensor_parallel_error = staticmethod(deepseek_tensor_parallel_error)

    def __init__(self, cfg: ModelConfig, max_position: int, tp: TensorParallel = SINGLE) -> None:
        if cfg.mla is None:
            raise CheckpointError(f"{cfg.architecture}: no multi-head latent attention settings (kv_lora_rank)")
        if cfg.qkv_bias:
            raise CheckpointError(f"attention_bias=True is not supported for {cfg.architecture}")
        if tp.enabled:
            raise CheckpointError(f"{cfg.architecture}: {deepseek_tensor_parallel_error(cfg, tp.size)}")
        super().__init__(cfg, max_position, tp)
        self.rope_interleave = cfg.mla.rope_interleave

    def attention_layers(self) -> list[nn.Module]:
        """The modules the runner binds each layer's cache to (``k_cache``; no ``v_cache``)."""
        return [layer.self_attn for layer in self.layers]

    def make_rotary(self, cfg: ModelConfig, max_position: int) -> RotaryEmbedding:
        assert cfg.mla is not None
        return RotaryEmbedding(cfg.mla.qk_rope_head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)

    def make_mlp(self, cfg: ModelConfig, index: int) -> nn.Module:
        if cfg.is_moe_layer(index):
            return DeepseekMoE(cfg, f"layers.{index}.mlp")
        return LlamaMLP(cfg.hidden_size, cfg.intermediate_size, self.tp, cfg=cfg, prefix=f"layers.{index}.mlp")

    def _skipped(self, name: str) -> bool:
        """Also V3's multi-token-prediction layers (numbered from num_hidden_layers on), as HF skips them."""
        if name.startswith("layers."):
            index = name.split(".", 2)[1]
            if index.isdigit() and int(index) >= self.config.num_layers:
                return True
        return super()._skipped(name)

    def _head_layout(self, owner: str, index: int, pname: str, tensor: torch.Tensor) -> torch.Tensor:
        """The rope rows of the query (every head) and of the shared key in neox order
        (``interleaved_rope_order``), of a weight or of a quantized projection's part
        (``_take_rows``); any other tensor as it is."""
        mla = self.config.mla
        if not self.rope_interleave or mla is None:
            return tensor
        query = (owner.endswith("self_attn.qkv_proj") and index == 0 and mla.q_lora_rank is None) or owner.endswith(
            "self_attn.q_b_proj")
        if not query and not (owner.endswith("self_attn.qkv_proj") and index == 1):
            return tensor
        # on the checkpoint tensor's device, which need not be the model's
        order, dev = interleaved_rope_order(mla.qk_rope_head_dim, tensor.device), tensor.device
        if query:
            head = torch.cat((torch.arange(mla.qk_nope_head_dim, device=dev), mla.qk_nope_head_dim + order))
            rows = (torch.arange(self.config.num_heads, device=dev)[:, None] * mla.qk_head_dim + head).reshape(-1)
        else:
            rows = torch.cat((torch.arange(mla.kv_lora_rank, device=dev), mla.kv_lora_rank + order))
        scheme = self.get_submodule(owner).scheme
        return _take_rows(tensor, rows, pname, scheme.block_n if isinstance(scheme, Fp8Weights) else 1)


def _take_rows(tensor: torch.Tensor, rows: torch.Tensor, pname: str, block_n: int = 1) -> torch.Tensor:
    """A projection's part with its output rows in the order ``rows`` gives: a weight, a bias or a
    quantized part (their rows are the outputs); ``perm`` (input columns) as it is, and fp8 scales
    of ``block_n`` rows each (or one for the tensor) as they are, where every row stays in its
    block (ValueError otherwise)."""
    n = rows.numel()
    if pname == "perm" or (pname == "weight_scale" and tensor.shape[0] == 1):
        return tensor
    if pname != "weight_scale" or block_n == 1:
        return tensor[rows]
    if not torch.equal(rows // block_n, torch.arange(n, device=rows.device) // block_n):
        raise ValueError(f"the rope rows' reorder moves rows across the {block_n}-row scale blocks of {pname}")
    return tensor
