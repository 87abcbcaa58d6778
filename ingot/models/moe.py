"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE.

They are the Llama family (``llama.py``: attention, q/k norm, decoder layer,
weight loading) with ``MoEBlock`` as the MLP of their sparse layers; the four
differ only in ModelConfig fields. The block's routing is plain PyTorch, the
glue ``torch.compile`` fuses: router logits in the model dtype, softmax in
fp32, top-k, optional renormalisation, and the weights cast back to the model
dtype (Mixtral keeps them in fp32, as HF does). Inductor keeps ``torch.topk`` an
ATen call, two kernels that take about a tenth of a Qwen3-30B-A3B layer at batch 1;
traced, the top-k is written as k rounds of max-and-mask
(``select_topk``: the same values and ids, ties aside; the renormalisation and the
cast applied to each value before they are joined), which Inductor fuses with the
softmax into one kernel. The experts run as one opaque
op, ``torch.ops.ingot.fused_moe`` (``layers/fused_moe.py``; ``fused_moe_int`` /
``fused_moe_fp8`` when the checkpoint's experts are quantized). Qwen2-MoE adds a
shared expert on every token, scaled by a sigmoid gate; its gate row rides
along in the router's GEMM.

Under tensor parallelism the router is replicated (every rank routes every
token alike), each expert and the shared expert are split by their
intermediate features, and the block all-reduces once: the routed and shared
partial sums together.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from ingot.distributed.collectives import all_reduce
from ingot.distributed.parallel import SINGLE, TensorParallel
from ingot.layers.fused_moe import FusedMoE, stacked_scheme
from ingot.layers.linear import MergedLinear, linear_norm_linear_scaled
from ingot.layers.norm import RMSNorm
from ingot.layers.policy import OpPolicy
from ingot.loading.errors import CheckpointError
from ingot.loading.model_config import ModelConfig
from ingot.loading.quant_scheme import LinearScheme
from ingot.models.llama import LlamaForCausalLM, LlamaMLP, tensor_parallel_error

# routed-expert tensors in every layout a checkpoint uses: one per expert and projection
# (`experts.3.gate_proj.weight`, or a quantized one's canonical parts `experts.3.gate_proj.qweight`...),
# transformers' fused `experts.gate_up_proj` / `experts.down_proj`, and GGUF's stacked
# `experts.gate_proj` (loading/gguf.py)
_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.)?(gate_proj|up_proj|down_proj|gate_up_proj)"
                     r"(?:\.(weight|qweight|scales|zeros|mins|perm|weight_scale|bias))?$")
# Mixtral's names for the same things
_MIXTRAL = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def _renamed(name: str) -> str:
    """A checkpoint name with Mixtral's parts in the names the other MoE models use."""
    for old, new in _MIXTRAL:
        name = name.replace(old, new)
    return name


def select_topk(
    probs: torch.Tensor, k: int, normalize: bool = False, out_dtype: Optional[torch.dtype] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(probs, k, dim=-1)`` (largest first) as k rounds of max, then mask the
    winner: reductions over one row and pointwise ops, which Inductor fuses into one kernel.

    ``normalize`` divides each value by the k values' sum (added up round by round) and
    ``out_dtype`` casts it, both before the values are joined: every op then works on one
    row's reduction results, so Inductor keeps them in the same kernel (after the join, a
    pointwise op over [T, k] or a sum over k is a kernel of its own)."""
    lanes = torch.arange(probs.shape[-1], device=probs.device)
    values, ids = [], []
    total: Optional[torch.Tensor] = None
    for _ in range(k):
        v, i = probs.max(dim=-1, keepdim=True)
        values.append(v)
        ids.append(i)
        total = v if total is None else total + v
        probs = probs.masked_fill(lanes == i, float("-inf"))
    if normalize:
        values = [v / total for v in values]
    if out_dtype is not None:
        values = [v.to(out_dtype) for v in values]
    return torch.cat(values, dim=-1), torch.cat(ids, dim=-1)


class MoEBlock(nn.Module):
    """Router, routed experts and (Qwen2-MoE) the gated shared expert of one layer."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE, prefix: str = "") -> None:
        """``prefix``: the block's checkpoint name (``layers.N.mlp``), which names the quantization
        of its shared expert and of its routed experts (``experts_scheme``)."""
        super().__init__()
        self.tp = tp
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weights_in_model_dtype = cfg.architecture != "MixtralForCausalLM"
        self.topk_then_softmax = cfg.topk_then_softmax
        shared = cfg.shared_expert_intermediate_size
        # router rows, then the shared expert's gate row: one GEMM for both
        self.gate = MergedLinear(cfg.hidden_size, (cfg.num_experts, 1) if shared else (cfg.num_experts,), cfg.router_bias)
        self.experts = routed_experts(cfg, prefix, tp)
        self.shared_expert = (LlamaMLP(cfg.hidden_size, shared, tp, reduce=False, cfg=cfg, prefix=f"{prefix}.shared_expert")
                              if shared else None)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k weights [T, k], expert ids [T, k]) from router logits [T, E], as HF computes them
        (gpt-oss: the k largest logits, then a softmax over them in the logits' dtype)."""
        if self.topk_then_softmax:
            top = select_topk if torch.compiler.is_compiling() else lambda x, k: torch.topk(x, k, dim=-1)
            values, ids = top(logits, self.top_k)
            return torch.softmax(values, dim=-1, dtype=values.dtype), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if torch.compiler.is_compiling():
            out_dtype = logits.dtype if self.weights_in_model_dtype else None
            return select_topk(probs, self.top_k, self.norm_topk_prob, out_dtype)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        return weights, ids

    def forward(self, h: torch.Tensor, policy: OpPolicy) -> torch.Tensor:
        """The block's output for normed hidden states ``h`` [T, H]."""
        return self.experts_forward(h, self.gate(h, policy), policy)

    def experts_forward(
        self, h: torch.Tensor, logits: torch.Tensor, policy: OpPolicy, row_scale: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """The block's output for normed hidden states ``h`` (or, with ``row_scale``, rows whose
        product with it is the normed states: ``norm_linear_scaled``) and their router logits."""
        weights, ids = self.route(logits[:, : self.num_experts])
        out = self.experts(h, weights, ids, row_scale)
        if self.shared_expert is not None:
            shared = self.shared_expert(self.shared_expert.gate_up_proj(h, policy), policy)
            out = out + torch.sigmoid(logits[:, self.num_experts :]) * shared
        return all_reduce(out, self.tp)

    def norm_forward(
        self, x: torch.Tensor, proj: MergedLinear, residual: torch.Tensor, norm: RMSNorm, policy: OpPolicy
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(block(norm(proj(x) + residual)), proj(x) + residual): the decoder layer's MLP protocol
        (``proj`` is the attention's o_proj). Without a shared expert (whose GEMVs take no row
        scale) the norm and the router's GEMV ride in o_proj's GEMV, and the experts scale
        their sums by the norm's rstd (``linear_norm_linear_scaled``)."""
        if self.shared_expert is not None:
            h, residual = norm(proj(x, policy), residual, policy)
            return self(h, policy), residual
        logits, residual, hw, rstd = linear_norm_linear_scaled(x, proj, residual, norm, self.gate, policy)
        return self.experts_forward(hw, logits, policy, rstd), residual


def routed_experts(cfg: ModelConfig, prefix: str, tp: TensorParallel = SINGLE) -> FusedMoE:
    """The routed experts of MoE block ``prefix`` (``layers.N.mlp``): a FusedMoE held in their
    checkpoint's scheme (``experts_scheme``), with gpt-oss's biases and clamped SwiGLU where the
    config has them. Raises CheckpointError where they cannot be held so."""
    swiglu = (cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.swiglu_alpha > 0 else None
    scheme = experts_scheme(cfg, prefix)
    try:
        return FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, tp, scheme, cfg.expert_bias, swiglu)
    except ValueError as exc:
        raise CheckpointError(f"{prefix}.experts: {exc}") from None


def experts_scheme(cfg: ModelConfig, prefix: str) -> Optional[LinearScheme]:
    """The one scheme of the routed experts of block ``prefix`` (``stacked_scheme``), None when
    they are dense. Raises CheckpointError where experts or projections are quantized
    differently: FusedMoE holds them as one."""
    if cfg.quant is None:
        return None
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    projections: dict[tuple[Optional[LinearScheme], int, int], str] = {}
    for e in range(cfg.num_experts):
        for shards, n, k in ((("gate_proj", "up_proj"), i, h), (("down_proj",), h, i)):
            projections.setdefault((cfg.linear_scheme(f"{prefix}.experts.{e}", shards), n, k), f"experts.{e}.{shards[0]}")
    try:
        return stacked_scheme(projections)
    except ValueError as exc:
        raise CheckpointError(f"{prefix}: {exc}") from None


def moe_tensor_parallel_error(cfg: ModelConfig, size: int) -> Optional[str]:
    """``llama.tensor_parallel_error``, and the routed and shared experts' widths must divide by ``size``."""
    why = tensor_parallel_error(cfg, size)
    if why is None and cfg.moe_intermediate_size % size:
        why = f"moe_intermediate_size={cfg.moe_intermediate_size} is not divisible by tensor_parallel_size={size}"
    if why is None and cfg.shared_expert_intermediate_size % size:
        why = (f"shared_expert_intermediate_size={cfg.shared_expert_intermediate_size} is not divisible by "
               f"tensor_parallel_size={size}")
    return why


class MoEForCausalLM(LlamaForCausalLM):
    FUSED = {**LlamaForCausalLM.FUSED, "shared_expert_gate": ("gate", 1)}
    tensor_parallel_error = staticmethod(moe_tensor_parallel_error)
    # the MLP types whose routed experts (a FusedMoE at ``.experts``) load from expert tensors
    expert_blocks: tuple[type[nn.Module], ...] = (MoEBlock,)

    def make_mlp(self, cfg: ModelConfig, index: int) -> nn.Module:
        if cfg.is_moe_layer(index):
            return MoEBlock(cfg, self.tp, f"layers.{index}.mlp")
        return LlamaMLP(cfg.hidden_size, cfg.intermediate_size, self.tp, cfg=cfg, prefix=f"layers.{index}.mlp")

    def _expert(self, name: str) -> Optional[tuple[int, nn.Module, Optional[int], str, str]]:
        """(layer, its MoE block, expert index or None when stacked, projection, part) of an expert
        tensor (a name with Mixtral's parts renamed); None for every other tensor."""
        m = _EXPERT.match(name)
        if m is None:
            return None
        layer, expert, proj, part = int(m.group(1)), m.group(2), m.group(3), m.group(4) or "weight"
        block = self.layers[layer].mlp if layer < len(self.layers) else None
        if not isinstance(block, self.expert_blocks):
            raise CheckpointError(f"checkpoint tensor {name!r}: layer {layer} of {self.config.architecture} has no experts")
        return layer, block, None if expert is None else int(expert), proj, part

    def tensor_slice(self, name: str) -> Optional[tuple[slice, ...]]:
        name = _renamed(name)
        found = self._expert(name)
        if found is None:
            return super().tensor_slice(name)
        _, block, expert, proj, part = found
        return block.experts.checkpoint_slice(proj, expert, part)

    def load_tensor(self, name: str, tensor: torch.Tensor) -> list[str]:
        """Expert tensors go to their layer's FusedMoE (copied into its slice of the stacked
        parameters); everything else loads as in the dense model."""
        name = _renamed(name)
        found = self._expert(name)
        if found is None:
            return super().load_tensor(name, tensor)
        layer, block, expert, proj, part = found
        try:
            keys = block.experts.load(proj, expert, tensor, part)
        except ValueError as exc:
            raise CheckpointError(f"{name}: {exc}") from None
        return [f"layers.{layer}.mlp.experts.{k}" for k in keys]

    def expected_keys(self) -> set[str]:
        keys = {k for k in super().expected_keys() if ".mlp.experts." not in k}
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, self.expert_blocks):
                keys.update(f"layers.{i}.mlp.experts.{k}" for k in layer.mlp.experts.expected_keys())
        return keys
