"""The llama.cpp conventions of the GGUF families whose HF config needs more than the common keys.

llama.cpp decides some of a family's settings in code rather than in the file (Gemma's
attention scale by model size, its sliding-window layer pattern, Gemma 3's local rope base);
this module reproduces those rules so an HF config built from a GGUF behaves as llama.cpp
runs the file. ``gguf`` maps the common keys and names and calls in here per architecture.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch

from ingot.loading.errors import CheckpointError

GEMMA_ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
FAMILY_ARCHITECTURES = {**GEMMA_ARCHITECTURES, "phi3": "Phi3ForCausalLM"}
# the families whose rotary may cover part of each head (rope.dimension_count < key_length)
PARTIAL_ROTARY = frozenset({"phi3"})
# llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w (its norm multiplies by the
# weight); HF's Gemma norm multiplies by 1 + w, so the loader subtracts the 1 again
NORM_PLUS_ONE = frozenset(GEMMA_ARCHITECTURES)
# llama.cpp: every n-th layer is global (Gemma 2 and gpt-oss: odd layers; Gemma 3: one in six)
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2}
# llama.cpp's model sizes whose attention scale is 1/sqrt(hidden / heads), not 1/sqrt(head_dim)
_SCALE_BY_WIDTH_LAYERS = {"gemma2": 46, "gemma3": 62}  # the 27B models


def meta_int(meta: dict[str, Any], key: str, default: Optional[int] = None) -> int:
    """An integer metadata value; a per-layer array only when every layer agrees."""
    value = meta.get(key, default)
    if isinstance(value, list):
        if value and all(v == value[0] for v in value):
            value = value[0]
        else:
            raise CheckpointError(f"GGUF metadata {key} varies per layer ({value[:8]}...), which is not supported")
    if value is None:
        raise CheckpointError(f"GGUF metadata is missing {key!r}")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise CheckpointError(f"GGUF metadata {key} should be a number, got {value!r}")
    return int(value)


def meta_float(meta: dict[str, Any], key: str, default: float) -> float:
    value = meta.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise CheckpointError(f"GGUF metadata {key} should be a number, got {value!r}")
    return float(value)


def block_overrides(arch: str, tensors: Mapping[str, object]) -> dict[str, str]:
    """The family's own llama.cpp block tensor -> HF module names. Gemma's pre-MLP norm is
    ``ffn_norm`` (Llama's post-attention norm); Phi-3's q/k/v come as one ``attn_qkv`` and, in a
    file without ``ffn_gate``, its gate and up as one ``ffn_up`` (gate rows first, as HF's)."""
    if arch in GEMMA_ARCHITECTURES:
        return {"ffn_norm": "pre_feedforward_layernorm"}
    if arch == "phi3":
        fused_up = not any(name.endswith(".ffn_gate.weight") for name in tensors)
        return {"attn_qkv": "self_attn.qkv_proj", **({"ffn_up": "mlp.gate_up_proj"} if fused_up else {})}
    return {}


def family_config(meta: dict[str, Any], arch: str, config: dict[str, Any], tensors: Mapping[str, object],
                  read: Callable[[str], torch.Tensor]) -> dict[str, Any]:
    """The HF config fields of ``arch`` beyond the common ones ({} for families without any);
    ``read`` reads a (small) tensor the config is kept in."""
    if arch in GEMMA_ARCHITECTURES:
        return _gemma_config(meta, arch, config)
    if arch == "phi3":
        return _phi3_config(meta, config, tensors, read)
    return {}


def _phi3_config(meta: dict[str, Any], config: dict[str, Any], tensors: Mapping[str, object],
                 read: Callable[[str], torch.Tensor]) -> dict[str, Any]:
    """Phi-3: partial rotary (rope.dimension_count of key_length), LongRoPE from the
    ``rope_factors_long`` / ``rope_factors_short`` tensors llama.cpp's converter writes, with the
    original context and attention factor from the metadata, and the sliding window."""
    head_dim = config["head_dim"]
    rot_dim = meta_int(meta, "phi3.rope.dimension_count", head_dim)
    if not 0 < rot_dim <= head_dim or rot_dim % 2:
        raise CheckpointError(f"GGUF metadata phi3.rope.dimension_count={rot_dim} does not fit {head_dim}-dim heads")
    out: dict[str, Any] = {"partial_rotary_factor": rot_dim / head_dim}
    window = meta_int(meta, "phi3.attention.sliding_window", 0)
    if window:
        out["sliding_window"] = window
    present = [name for name in ("rope_factors_long.weight", "rope_factors_short.weight") if name in tensors]
    if not present:
        return out
    if len(present) == 1:
        raise CheckpointError(f"the GGUF has {present[0]} without the other of rope_factors_long / rope_factors_short")
    original = meta_int(meta, "phi3.rope.scaling.original_context_length")
    long, short = (read(name).float().flatten().tolist() for name in ("rope_factors_long.weight", "rope_factors_short.weight"))
    if len(long) != rot_dim // 2 or len(short) != rot_dim // 2:
        raise CheckpointError(f"rope_factors_long / rope_factors_short have {len(long)} / {len(short)} entries, "
                              f"not {rot_dim // 2} (rotary dims / 2)")
    scaling: dict[str, Any] = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                               "original_max_position_embeddings": original}
    if "phi3.rope.scaling.attn_factor" in meta:
        scaling["attention_factor"] = meta_float(meta, "phi3.rope.scaling.attn_factor", 1.0)
    out.update(rope_scaling=scaling, original_max_position_embeddings=original)
    return out


def _gemma_config(meta: dict[str, Any], arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 / 3 as llama.cpp runs them: soft-caps (Gemma 2's default to 50 / 30), the sliding
    window (Gemma 2's defaults to 4096; a Gemma 3 file without one has only global layers), the
    layer pattern, the attention scale and, for Gemma 3, the local layers' rope base."""
    p = arch + "."
    layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    if layers == _SCALE_BY_WIDTH_LAYERS[arch]:
        scalar = hidden // heads
    else:
        scalar = config["head_dim"]
    window = meta_int(meta, p + "attention.sliding_window", 4096 if arch == "gemma2" else 0)
    out: dict[str, Any] = {
        "model_type": "gemma3_text" if arch == "gemma3" else arch,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": window or None,
        "layer_types": layer_types(meta, arch, layers, window),
        "attn_logit_softcapping": _softcap(meta, p + "attn_logit_softcapping", 50.0 if arch == "gemma2" else None),
        "final_logit_softcapping": _softcap(meta, p + "final_logit_softcapping", 30.0 if arch == "gemma2" else None),
    }
    if arch == "gemma3":
        out["rope_local_base_freq"] = meta_float(meta, p + "rope.freq_base_swa", 10000.0)
    return out


def _softcap(meta: dict[str, Any], key: str, default: Optional[float]) -> Optional[float]:
    value = meta_float(meta, key, default) if key in meta or default is not None else None
    return value or None


def layer_types(meta: dict[str, Any], arch: str, layers: int, window: int) -> list[str]:
    """Each layer's attention type: llama.cpp's pattern (every n-th layer global), or the file's
    ``attention.sliding_window_pattern`` (a period, or one flag per layer: true = sliding)."""
    if not window:
        return ["full_attention"] * layers
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", _SWA_PATTERN[arch])
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise CheckpointError(f"GGUF metadata {arch}.attention.sliding_window_pattern has {len(pattern)} "
                                  f"entries for {layers} layers")
        slides = [bool(s) for s in pattern]
    else:
        period = meta_int(meta, f"{arch}.attention.sliding_window_pattern", _SWA_PATTERN[arch])
        slides = [period == 0 or i % period < period - 1 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in slides]
