"""A GGUF's metadata (llama.cpp's keys) -> an HF config.json dict.

The keys every family shares are mapped here (sizes, heads, rope, the MoE counts of the
llama / qwen MoE families); the families whose settings llama.cpp keeps partly in code add
theirs through ``gguf_families`` (Gemma, Phi-3) and ``gguf_moe_families`` (DeepSeek-V2 / V3,
gpt-oss). ``gguf.py`` calls ``hf_config`` once per file, before any weight is read.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional

import numpy as np
import torch

from ingot.loading.errors import CheckpointError
from ingot.loading.gguf_families import FAMILY_ARCHITECTURES, PARTIAL_ROTARY, family_config, meta_int
from ingot.loading.gguf_file import TensorInfo
from ingot.loading.gguf_moe_families import MOE_FAMILY_ARCHITECTURES, OWN_ROTARY_DIMS, moe_family_config

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # MixtralForCausalLM when the file has experts
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    **FAMILY_ARCHITECTURES,
    **MOE_FAMILY_ARCHITECTURES,
}
# llama.cpp renormalises the top-k routing weights per architecture unless the file says
# otherwise ({arch}.expert_weights_norm): Mixtral and Qwen3-MoE yes, Qwen2-MoE no
_NORM_TOPK = {"llama": True, "qwen3moe": True, "qwen2moe": False}

Reader = Callable[[str], torch.Tensor]  # reads one (small) tensor of the file by its llama.cpp name


def hf_config(meta: dict[str, Any], arch: str, tensors: Mapping[str, TensorInfo], read: Reader) -> dict[str, Any]:
    """llama.cpp metadata keys -> an HF config.json dict; ``read`` reads the tensors some
    settings are kept in (rope_freqs, Phi-3's rope factors)."""
    p = arch + "."
    hidden = meta_int(meta, p + "embedding_length")
    heads = meta_int(meta, p + "attention.head_count")
    kv_heads = meta_int(meta, p + "attention.head_count_kv", heads)
    head_dim = meta_int(meta, p + "attention.key_length", hidden // heads)
    rot_dim = meta_int(meta, p + "rope.dimension_count", head_dim)
    if rot_dim != head_dim and arch not in PARTIAL_ROTARY | OWN_ROTARY_DIMS:
        raise CheckpointError(f"partial rotary embeddings ({rot_dim} of {head_dim} dims) are not supported")
    theta = float(meta.get(p + "rope.freq_base", 10000.0))
    if p + "vocab_size" in meta:
        vocab = meta_int(meta, p + "vocab_size")
    elif "token_embd.weight" in tensors:
        vocab = tensors["token_embd.weight"].shape[0]
    else:
        vocab = len(meta.get("tokenizer.ggml.tokens", ()))
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": meta_int(meta, p + "feed_forward_length", 0 if _has_expert_width(arch) else None),
        "num_hidden_layers": meta_int(meta, p + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(meta, p, tensors, read, theta, head_dim),
        "max_position_embeddings": meta_int(meta, p + "context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    config.update(_moe_config(meta, arch, tensors))
    config.update(family_config(meta, arch, config, tensors, read))
    config.update(moe_family_config(meta, arch, config, tensors))
    return config


def _has_expert_width(arch: str) -> bool:
    """Whether the family's MLP width may come from its expert keys alone (feed_forward_length optional)."""
    return arch.endswith("moe") or arch in MOE_FAMILY_ARCHITECTURES


def _moe_config(meta: dict[str, Any], arch: str, tensors: Mapping[str, TensorInfo]) -> dict[str, Any]:
    """The HF MoE fields of a llama / qwen GGUF with experts ({} without, and for the families
    of ``gguf_moe_families``, which map their own): counts, widths, routing, dense layers."""
    p = arch + "."
    experts = meta_int(meta, p + "expert_count", 0)
    if not experts or arch in MOE_FAMILY_ARCHITECTURES:
        if arch.endswith("moe") and not experts:
            raise CheckpointError(f"{arch} GGUF metadata has no {p}expert_count")
        return {}
    if arch not in _NORM_TOPK:
        raise CheckpointError(f"mixture-of-experts {arch} GGUFs are not supported")
    out: dict[str, Any] = {
        "num_experts_per_tok": meta_int(meta, p + "expert_used_count"),
        "norm_topk_prob": bool(meta.get(p + "expert_weights_norm", _NORM_TOPK[arch])),
    }
    if arch == "llama":  # Mixtral: feed_forward_length is the expert width
        out["architectures"] = ["MixtralForCausalLM"]
        out["num_local_experts"] = experts
        return out
    out["num_experts"] = experts
    out["moe_intermediate_size"] = meta_int(meta, p + "expert_feed_forward_length")
    layers = meta_int(meta, p + "block_count")
    shared = [tensors[n] for i in range(layers) if (n := f"blk.{i}.ffn_gate_shexp.weight") in tensors]
    if shared:
        out["shared_expert_intermediate_size"] = meta_int(meta, p + "expert_shared_feed_forward_length", shared[0].shape[0])
    out["mlp_only_layers"] = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    return out


def _rope_scaling(
    meta: dict[str, Any], p: str, tensors: Mapping[str, TensorInfo], read: Reader, theta: float, head_dim: int
) -> Optional[dict[str, Any]]:
    kind = meta.get(p + "rope.scaling.type")
    factor = meta.get(p + "rope.scaling.factor", meta.get(p + "rope.scale_linear"))
    if kind is None and factor is not None:
        kind = "linear"  # old files: rope.scale_linear only
    if kind in ("linear", "yarn") and factor is not None and float(factor) != 1.0:
        out: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        if kind == "yarn":
            out["original_max_position_embeddings"] = meta_int(meta, p + "rope.scaling.original_context_length")
            for key in ("beta_fast", "beta_slow"):  # written when the HF config sets them
                if p + f"rope.scaling.yarn_{key}" in meta:
                    out[key] = float(meta[p + f"rope.scaling.yarn_{key}"])
        return out
    if kind not in (None, "none", "linear", "yarn"):
        raise CheckpointError(f"unsupported rope scaling type {kind!r} in GGUF metadata")
    if "rope_freqs.weight" in tensors:
        return _llama3_from_freqs(read("rope_freqs.weight").float().numpy(), theta, head_dim)
    return None


def _llama3_from_freqs(divisors: np.ndarray, theta: float, head_dim: int) -> Optional[dict[str, Any]]:
    """Recover Llama-3.1-style rope_scaling from llama.cpp's precomputed rope_freqs.

    The file stores only the per-frequency divisors; the HF parameters are found
    by trying the values Meta's models use and keeping the one that reproduces them.
    """
    factor = float(divisors.max())
    if factor == 1.0:
        return None
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    for ctx in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0)):
            smooth = (ctx / wavelen - low) / (high - low)
            medium = 1.0 / ((1 - smooth) / factor + smooth)
            expect = np.where(wavelen < ctx / high, 1.0, np.where(wavelen > ctx / low, factor, medium))
            if expect.shape == divisors.shape and np.allclose(expect, divisors, rtol=1e-3):
                return {
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": ctx,
                }
    raise CheckpointError("the GGUF's rope_freqs tensor matches no known llama3 rope scaling; not supported")
