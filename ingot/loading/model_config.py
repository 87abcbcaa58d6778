"""ModelConfig: the architecture facts ingot needs, read from an HF config.json dict.

Dense variations of the Llama block are flags: Phi-3 (partial rotary,
LongRoPE), OLMo 2 (q/k norm over the whole projection; its norm placement is
``models/olmo2.py``), SmolLM3 (layers without rotary).

Mixture-of-experts fields (``num_experts`` > 0) follow the HF names of the four
families ingot runs: Qwen3-MoE, Qwen2-MoE (a shared expert with a sigmoid
gate), Mixtral (every layer sparse, ``intermediate_size`` is the expert width,
top-k weights always renormalised) and OLMoE (q/k norm over the whole
projection instead of per head). gpt-oss adds attention sinks, biases on o_proj, the router
and the experts, a top-k-then-softmax router and a clamped SwiGLU (``_gpt_oss_fields``). DeepSeek-V2 / V3 add ``mla`` (latent
attention) and ``routing`` (grouped top-k), read by ``deepseek_config.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ingot.loading.deepseek_config import GroupedRouting, MLAConfig, deepseek_fields
from ingot.loading.errors import CheckpointError
from ingot.loading.quant_scheme import LinearScheme, QuantConfig

@dataclass(frozen=True)
class KVCacheEntry:
    """What the paged cache holds per token and layer: ``heads`` x ``head_dim`` keys, and as
    many values in a tensor of their own when ``separate_values`` (multi-head latent attention
    caches one entry, the latent and the rope'd key, whose prefix serves as the value)."""

    heads: int
    head_dim: int
    separate_values: bool = True

    @property
    def values_per_token(self) -> int:
        """Cached elements per token and layer."""
        return self.heads * self.head_dim * (2 if self.separate_values else 1)


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: Optional[dict[str, Any]] = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    # per decoder layer: the sliding attention window it attends within (0: global attention); () none
    layer_windows: tuple[int, ...] = ()
    qk_norm_full_width: bool = False  # OLMoE: q_norm / k_norm over all heads of the projection at once
    clip_qkv: Optional[float] = None  # OLMoE: q, k (after their norms) and v clamped to +-clip_qkv
    partial_rotary_factor: float = 1.0  # Phi-3/4: rotary on the first fraction of each head's dims
    nope_layers: tuple[int, ...] = ()  # SmolLM3: decoder layers that skip rotary
    # mixture of experts (num_experts == 0: a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # width of one routed expert
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (0: none)
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (dense MLP of intermediate_size)
    torch_dtype: Optional[torch.dtype] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)
    quant: Optional[QuantConfig] = None  # how the linear layers are held (None: in the model dtype)
    # Gemma 2 / 3 (0 or None: not used)
    query_pre_attn_scalar: Optional[float] = None  # the attention scale is its inverse square root (else head_dim's)
    attn_logit_softcap: float = 0.0  # attention logits -> cap * tanh(logits / cap)
    final_logit_softcap: float = 0.0  # output logits, likewise
    local_rope_theta: Optional[float] = None  # Gemma 3: the rope base of sliding-window layers (unscaled)
    o_bias: bool = False  # o_proj has a bias (HF's attention_bias in the families whose o_proj reads it)
    # gpt-oss (False / 0: not used)
    attn_sinks: bool = False  # a learned logit per query head in each attention softmax's denominator
    router_bias: bool = False  # the MoE router (gate) has a bias
    expert_bias: bool = False  # every routed expert's gate/up and down projections have biases
    topk_then_softmax: bool = False  # routing weights: softmax over the k largest logits (else top-k of the softmax)
    swiglu_alpha: float = 0.0  # > 0: the experts' activation is the clamped SwiGLU (reference_quant.activation)
    swiglu_limit: float = 0.0
    # DeepSeek-V2 / V3 (None: not used); head_dim is then the q/k head width (nope + rope dims)
    mla: Optional[MLAConfig] = None
    routing: Optional[GroupedRouting] = None

    @property
    def kv_cache_entry(self) -> KVCacheEntry:
        """The paged cache's entry per token and layer (the KV pool's shape and its size)."""
        if self.mla is not None:
            return KVCacheEntry(1, self.mla.cache_dim, separate_values=False)
        return KVCacheEntry(self.num_kv_heads, self.head_dim)

    def layer_window(self, index: int) -> int:
        """Decoder layer ``index``'s sliding window (0: it attends to the whole context)."""
        return self.layer_windows[index] if self.layer_windows else 0

    @property
    def kv_window(self) -> Optional[int]:
        """The widest window when every layer has one (a sequence's KV blocks wholly before it
        are read by no layer again), else None (some layer attends to the whole context)."""
        if self.layer_windows and all(self.layer_windows):
            return max(self.layer_windows)
        return None

    def linear_scheme(self, prefix: str, shards: tuple[str, ...]) -> Optional[LinearScheme]:
        """The quantization of the (merged) linear module whose checkpoint modules are
        ``model.{prefix}.{shard}``: they must agree, since they are held as one."""
        if self.quant is None:
            return None
        schemes = {self.quant.scheme_for(f"model.{prefix}.{shard}") for shard in shards}
        if len(schemes) > 1:
            raise CheckpointError(f"{prefix}: {', '.join(shards)} are quantized differently ({schemes}); ingot holds "
                                  "them as one projection")
        return schemes.pop()

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that rotate (HF: ``int(head_dim * partial_rotary_factor)``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` has routed experts (HF's rule for the Qwen MoE families,
        DeepSeek's ``first_k_dense_replace`` / ``moe_layer_freq``)."""
        if self.routing is not None:
            return self.num_experts > 0 and self.routing.is_sparse(index)
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if not archs:
            raise CheckpointError("config.json has no 'architectures' entry")
        arch = archs[0]
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            inter = int(cfg["intermediate_size"])
            vocab = int(cfg["vocab_size"])
        except KeyError as exc:
            raise CheckpointError(f"config.json is missing {exc.args[0]!r}") from None
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise CheckpointError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        # transformers >= 5 keeps rope settings in `rope_parameters`
        per_type = dict(cfg.get("rope_parameters") or {})
        rope = per_type.get("full_attention") or per_type  # Gemma 3: one set per layer type
        theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or (1e6 if arch == "Gemma3ForCausalLM" else 10000.0))
        scaling = _rope_scaling(cfg, rope)
        eos = cfg.get("eos_token_id")
        dtype_name = cfg.get("torch_dtype") or cfg.get("dtype")
        moe = _moe_fields(arch, cfg, inter)
        fields = dict(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in _GEMMA)),  # (Gemma's default: tied)
            qkv_bias=_qkv_bias(arch, cfg),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM", "Olmo2ForCausalLM",
                             "Gemma3ForCausalLM"),
            qk_norm_full_width=arch in ("OlmoeForCausalLM", "Olmo2ForCausalLM"),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0),
            nope_layers=_nope_layers(arch, cfg, layers),
            clip_qkv=float(cfg["clip_qkv"]) if cfg.get("clip_qkv") is not None else None,
            layer_windows=_layer_windows(arch, cfg, layers),
            torch_dtype=_DTYPES.get(str(dtype_name)) if dtype_name else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            o_bias=_attention_bias(arch, cfg) and arch not in _NO_O_BIAS,
            **moe,
            **_gemma_fields(arch, cfg, per_type),
            **_gpt_oss_fields(arch, cfg, layers),
        )
        fields.update(deepseek_fields(arch, cfg))
        return cls(**fields)


def _rope_scaling(cfg: dict[str, Any], rope: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The rope scaling settings (None: plain rope). LongRoPE's (Phi-3 ``su`` / ``longrope``) gain
    ``original_max_position_embeddings`` from the top level, where Phi-3 configs keep it, and
    ``factor`` (HF's default: the ratio of the two context lengths); YaRN's the same defaults
    (HF: the original context defaults to ``max_position_embeddings``)."""
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if kind == "yarn":
        scaling = dict(scaling)
        original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = int(original or cfg.get("max_position_embeddings", 4096))
        if scaling.get("factor") is None:
            scaling["factor"] = int(cfg.get("max_position_embeddings", 4096)) / scaling["original_max_position_embeddings"]
        if not float(scaling["factor"]) > 0 or scaling["original_max_position_embeddings"] <= 0:
            raise CheckpointError(f"rope_scaling (yarn): factor={scaling['factor']} and original_max_position_embeddings="
                                  f"{scaling['original_max_position_embeddings']} must be positive")
        return scaling
    if kind not in ("su", "longrope"):
        return scaling
    scaling = dict(scaling)
    original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    if not original:
        raise CheckpointError("LongRoPE scaling needs original_max_position_embeddings (rope_scaling or config.json)")
    scaling["original_max_position_embeddings"] = int(original)
    if scaling.get("factor") is None:
        scaling["factor"] = int(cfg.get("max_position_embeddings", 4096)) / int(original)
    return scaling


def _nope_layers(arch: str, cfg: dict[str, Any], layers: int) -> tuple[int, ...]:
    """SmolLM3's layers without rotary: ``no_rope_layers[i] == 0`` (1 means rotary), by default
    every ``no_rope_layer_interval``-th layer (HF's rule)."""
    if arch != "SmolLM3ForCausalLM":
        return ()
    interval = int(cfg.get("no_rope_layer_interval") or 4)
    flags = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise CheckpointError(f"no_rope_layers has {len(flags)} entries for num_hidden_layers={layers}")
    return tuple(i for i, uses_rope in enumerate(flags) if not uses_rope)


# HF's rule for which layers slide when the config has no `layer_types` list: every layer
# (Mistral, Mixtral: they never read the list), or by layer index
_SLIDING_RULES = {
    "Gemma2ForCausalLM": lambda i, cfg: i % 2 == 0,
    "Gemma3ForCausalLM": lambda i, cfg: (i + 1) % int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
                                                      or 6) != 0,
    "Qwen2ForCausalLM": lambda i, cfg: i >= int(cfg.get("max_window_layers", 28)),
    "Qwen3ForCausalLM": lambda i, cfg: i >= int(cfg.get("max_window_layers", 28)),
    "Qwen2MoeForCausalLM": lambda i, cfg: i % 2 == 0 and i < int(cfg.get("max_window_layers", 28)),
    "GptOssForCausalLM": lambda i, cfg: i % 2 == 0,
}
_IGNORE_LAYER_TYPES = ("MistralForCausalLM", "MixtralForCausalLM")
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_ALWAYS_SLIDING = _GEMMA  # no `use_sliding_window` switch


def _layer_windows(arch: str, cfg: dict[str, Any], layers: int) -> tuple[int, ...]:
    """Each decoder layer's sliding window (0: global), as HF decides it: the config's
    `layer_types` where the model reads them, else the architecture's rule; () for none.
    Qwen configs slide only with `use_sliding_window` (False unless set; their `sliding_window` is
    set regardless); Mistral's and Mixtral's whenever `sliding_window` is."""
    window = cfg.get("sliding_window")
    if not window or (arch not in _ALWAYS_SLIDING and not cfg.get("use_sliding_window", not arch.startswith("Qwen"))):
        return ()
    types = cfg.get("layer_types")
    if types and arch not in _IGNORE_LAYER_TYPES:
        slides = [t == "sliding_attention" for t in types[:layers]]
    else:
        rule = _SLIDING_RULES.get(arch, lambda i, cfg: True)
        slides = [rule(i, cfg) for i in range(layers)]
    return tuple(int(window) if s else 0 for s in slides) if any(slides) else ()


def _gemma_fields(arch: str, cfg: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """The Gemma 2 / 3 fields of ModelConfig ({} for other families). Gemma 3's rope settings come
    per layer type (`rope_parameters` of transformers 5) or as `rope_theta` and
    `rope_local_base_freq` (older configs)."""
    if arch not in _GEMMA:
        return {}
    fields: dict[str, Any] = dict(
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256),
        attn_logit_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
        final_logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
    )
    if arch == "Gemma3ForCausalLM":
        local = rope.get("sliding_attention") or {}
        fields["local_rope_theta"] = float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0)
    return fields


# families whose o_proj has no bias whatever attention_bias says (HF builds it with bias=False)
_NO_O_BIAS = ("MistralForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")
_LAYER_TYPES = ("sliding_attention", "full_attention")


def _gpt_oss_fields(arch: str, cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """gpt-oss's fields of ModelConfig ({} for other families), checked: a CheckpointError names
    the config field that cannot be served."""
    if arch != "GptOssForCausalLM":
        return {}
    types = cfg.get("layer_types")
    if types is not None and (len(types) != layers or any(t not in _LAYER_TYPES for t in types)):
        raise CheckpointError(f"layer_types must list {layers} entries (num_hidden_layers), each one of {_LAYER_TYPES}; "
                              f"got {types}")
    window = cfg.get("sliding_window")
    if window is not None and int(window) <= 0:
        raise CheckpointError(f"sliding_window={window} must be positive (or null for none)")
    alpha, limit = float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))
    if not (alpha > 0 and limit > 0):
        raise CheckpointError(f"swiglu_alpha={alpha} and swiglu_limit={limit} must be positive")
    return dict(attn_sinks=True, router_bias=True, expert_bias=True, topk_then_softmax=True, swiglu_alpha=alpha,
                swiglu_limit=limit)


def _qkv_bias(arch: str, cfg: dict[str, Any]) -> bool:
    if arch == "Qwen2ForCausalLM":
        return True
    if arch == "Qwen2MoeForCausalLM":  # HF: `qkv_bias` (default True; older configs lack the key); GGUF: attention_bias
        return bool(cfg.get("qkv_bias", cfg.get("attention_bias", True)))
    return _attention_bias(arch, cfg)


def _attention_bias(arch: str, cfg: dict[str, Any]) -> bool:
    """HF's ``attention_bias``, whose default is True for gpt-oss only."""
    return bool(cfg.get("attention_bias", arch == "GptOssForCausalLM"))


# architecture -> (HF key of the expert width, None for intermediate_size; top-k weights renormalised
# always (Mixtral) or as `norm_topk_prob` says)
_MOE_ARCHS = {
    "Qwen3MoeForCausalLM": ("moe_intermediate_size", False),
    "Qwen2MoeForCausalLM": ("moe_intermediate_size", False),
    "MixtralForCausalLM": (None, True),
    "OlmoeForCausalLM": (None, False),
    "GptOssForCausalLM": (None, False),
}
# the expert count: `num_experts` in the Qwen / OLMoE hub configs, `num_local_experts` in Mixtral's
# and in what recent transformers writes for all of them
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")


def _moe_fields(arch: str, cfg: dict[str, Any], inter: int) -> dict[str, Any]:
    """The MoE fields of ModelConfig for a mixture-of-experts architecture ({} for a dense one)."""
    if arch not in _MOE_ARCHS:
        return {}
    width_key, always_norm = _MOE_ARCHS[arch]
    try:
        experts = int(next((cfg[k] for k in _EXPERT_COUNT_KEYS if cfg.get(k) is not None), None) or cfg["num_experts"])
        top_k = int(cfg["num_experts_per_tok"])
        width = int(cfg[width_key]) if width_key else inter
    except KeyError as exc:
        raise CheckpointError(f"config.json of {arch} is missing {exc.args[0]!r}") from None
    if experts == 0:  # HF builds every layer dense then
        return {}
    if not 0 < top_k <= experts:
        raise CheckpointError(f"num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
    step = int(cfg.get("decoder_sparse_step") or 1)
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
        if arch == "Qwen2MoeForCausalLM" else 0,
        norm_topk_prob=always_norm or bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=step if arch.startswith("Qwen") else 1,
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()) if arch.startswith("Qwen") else (),
    )
