"""llama.cpp's ``deepseek2`` (DeepSeek-V2, V2-Lite, V3, R1) and ``gpt-oss`` GGUFs: their HF
config, the tensor names only they use, and the tensor llama.cpp's converter splits.

deepseek2. The file holds multi-head latent attention as llama.cpp runs it: since llama.cpp's
MLA layout the metadata describe multi-query attention over the latent (``head_count_kv`` 1,
``key_length`` kv_lora_rank + rope dims) and the per-head sizes are ``key_length_mla`` /
``value_length_mla``; older files have ``key_length`` / ``value_length`` per head. Likewise
``kv_b_proj`` comes whole (``attn_kv_b``, older files) or split per head into ``attn_k_b``
``[heads, kv_lora_rank, nope]`` (transposed) and ``attn_v_b`` ``[heads, v_head_dim,
kv_lora_rank]``; ``join_kv_b`` puts HF's ``[heads * (nope + v), kv_lora_rank]`` back together.
Routing: ``expert_gating_func`` sigmoid is DeepSeek-V3's (``exp_probs_b``: its correction bias),
softmax (the default of files without the key) V2's; groups, the scale and renormalisation
come from ``expert_group_count`` / ``expert_group_used_count``, ``expert_weights_scale`` and
``expert_weights_norm``. Where llama.cpp's kernels approximate the original model, ingot
runs the model's own rule (HF's): V2's groups rank by their best expert (llama.cpp: by their
best two, V3's rule). YaRN: llama.cpp keeps DeepSeek's ``mscale_all_dim`` as
``rope.scaling.yarn_log_multiplier`` = 0.1 x mscale_all_dim (it scales the softmax) and
rotates without YaRN's magnitude factor, which is HF's rule when ``mscale`` equals
``mscale_all_dim`` (every released model).

gpt-oss. llama.cpp fixes in code what HF configs set: every other layer slides (layer 0
first), the clamped SwiGLU's alpha 1.702 and limit 7. ingot runs gpt-oss's own YaRN, the
ramp's ends not rounded to whole dims (HF's ``truncate: false``; ggml's rope rounds them).
Attention sinks are
``attn_sinks.weight``; the experts' gate and up come as two stacked tensors (or, with the
converter's ``--fuse-gate-up-exps``, one ``ffn_gate_up_exps``, gate rows first) with biases,
MXFP4 when converted from the released checkpoints (``gguf_quant``).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, NamedTuple

import torch

from ingot.loading.errors import CheckpointError
from ingot.loading.gguf_families import layer_types, meta_float, meta_int
from ingot.loading.gguf_file import TensorInfo

MOE_FAMILY_ARCHITECTURES = {"deepseek2": "DeepseekV2ForCausalLM", "gpt-oss": "GptOssForCausalLM"}
# families whose rotary covers part of each head's key (rope.dimension_count < key_length)
OWN_ROTARY_DIMS = frozenset({"deepseek2"})
_DEEPSEEK2_NAMES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.kv_b_proj",  # joined with attn_v_b (join_kv_b)
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_SOFTMAX, _SIGMOID = 1, 2  # llama.cpp's expert_gating_func values
_K_B = re.compile(r"^blk\.(\d+)\.attn_k_b\.weight$")
_V_B = re.compile(r"^blk\.(\d+)\.attn_v_b\.weight$")


def moe_block_names(arch: str) -> dict[str, str]:
    """The family's own llama.cpp block tensor -> HF module names ({} for other families)."""
    return dict(_DEEPSEEK2_NAMES) if arch == "deepseek2" else {}


class Join(NamedTuple):
    """A second file tensor read with a first one into one HF tensor (deepseek2's attn_v_b with attn_k_b)."""

    second: TensorInfo
    shape: tuple[int, ...]  # the HF tensor's


def kv_b_joins(arch: str, tensors: Mapping[str, TensorInfo]) -> tuple[dict[str, Join], frozenset[str]]:
    """({attn_k_b name: its layer's attn_v_b}, the attn_k_b / attn_v_b tensors of layers that also
    store attn_kv_b, which are skipped); CheckpointError for half a split or shapes that disagree."""
    if arch != "deepseek2":
        return {}, frozenset()
    joins: dict[str, Join] = {}
    skipped: set[str] = set()
    halves = {(m.group(1), kind) for name in tensors for kind, rx in (("k", _K_B), ("v", _V_B)) if (m := rx.match(name))}
    for layer in sorted({layer for layer, _ in halves}, key=int):
        k_name, v_name = f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight"
        if f"blk.{layer}.attn_kv_b.weight" in tensors:
            skipped.update(n for n in (k_name, v_name) if n in tensors)
            continue
        if k_name not in tensors or v_name not in tensors:
            have, lack = (k_name, v_name) if k_name in tensors else (v_name, k_name)
            raise CheckpointError(f"the GGUF has {have} without {lack} (kv_b_proj split per head needs both)")
        k_b, v_b = tensors[k_name], tensors[v_name]
        if len(k_b.shape) != 3 or len(v_b.shape) != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
            raise CheckpointError(f"{k_name} {list(k_b.shape)} and {v_name} {list(v_b.shape)} are not "
                                  "[heads, kv_lora_rank, nope] and [heads, v_head_dim, kv_lora_rank]")
        heads, rank, nope = k_b.shape
        joins[k_name] = Join(v_b, (heads * (nope + v_b.shape[1]), rank))
    return joins, frozenset(skipped)


def join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """attn_k_b [heads, rank, nope] and attn_v_b [heads, v, rank] -> HF's kv_b_proj.weight
    [heads * (nope + v), rank]: each head's nope rows (k_b transposed back), then its v rows."""
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, k_b.shape[1]).contiguous()


def moe_family_config(meta: dict[str, Any], arch: str, config: dict[str, Any],
                      tensors: Mapping[str, TensorInfo]) -> dict[str, Any]:
    """The HF config fields of deepseek2 and gpt-oss beyond the common ones ({} for other families)."""
    if arch == "deepseek2":
        return _deepseek2_config(meta, config, tensors)
    if arch == "gpt-oss":
        return _gpt_oss_config(meta, config)
    return {}


def _deepseek2_config(meta: dict[str, Any], config: dict[str, Any], tensors: Mapping[str, TensorInfo]) -> dict[str, Any]:
    p = "deepseek2."
    heads = config["num_attention_heads"]
    rope = meta_int(meta, p + "rope.dimension_count")
    if p + "attention.key_length_mla" in meta:  # llama.cpp's MLA layout: key_length is the latent's
        qk, v = meta_int(meta, p + "attention.key_length_mla"), meta_int(meta, p + "attention.value_length_mla")
    else:
        qk = meta_int(meta, p + "attention.key_length")
        v = meta_int(meta, p + "attention.value_length", qk)
    if not 0 < rope < qk or rope % 2:
        raise CheckpointError(f"GGUF metadata {p}rope.dimension_count={rope} does not fit {qk}-dim query/key heads")
    sigmoid = _gating(meta) == _SIGMOID
    out: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if sigmoid else "deepseek_v2",
        "num_key_value_heads": heads,
        "head_dim": qk,
        "kv_lora_rank": meta_int(meta, p + "attention.kv_lora_rank"),
        "q_lora_rank": _q_lora_rank(meta, tensors),
        "qk_nope_head_dim": qk - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v,
        "rope_interleave": True,  # llama.cpp rotates DeepSeek's dims in pairs (its NORM rope)
        "rope_scaling": _deepseek2_yarn(meta, config["rope_scaling"]),
    }
    if meta_int(meta, p + "expert_count", 0):
        out.update(_deepseek2_routing(meta, config, tensors, sigmoid))
    return out


def _gating(meta: dict[str, Any]) -> int:
    gating = meta_int(meta, "deepseek2.expert_gating_func", _SOFTMAX)  # llama.cpp: softmax without the key
    if gating not in (_SOFTMAX, _SIGMOID):
        raise CheckpointError(f"GGUF metadata deepseek2.expert_gating_func={gating} is not supported "
                              f"({_SOFTMAX}: softmax, DeepSeek-V2; {_SIGMOID}: sigmoid, DeepSeek-V3)")
    return gating


def _q_lora_rank(meta: dict[str, Any], tensors: Mapping[str, TensorInfo]) -> int | None:
    """V3 / V2's low-rank query (attn_q_a's rows), None for V2-Lite's plain attn_q."""
    if "blk.0.attn_q_a.weight" not in tensors:
        if "blk.0.attn_q.weight" not in tensors:
            raise CheckpointError("the GGUF has neither blk.0.attn_q.weight nor blk.0.attn_q_a.weight")
        return None
    rows = tensors["blk.0.attn_q_a.weight"].shape[0]
    rank = meta_int(meta, "deepseek2.attention.q_lora_rank", rows)
    if rank != rows:
        raise CheckpointError(f"GGUF metadata deepseek2.attention.q_lora_rank={rank} but blk.0.attn_q_a.weight has {rows} rows")
    return rank


def _deepseek2_yarn(meta: dict[str, Any], scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """llama.cpp's DeepSeek YaRN: no magnitude factor on the rotation, mscale_all_dim from
    yarn_log_multiplier (0.1 x mscale_all_dim, float32: rounded back to 6 decimals)."""
    if not scaling or scaling.get("rope_type") != "yarn":
        return scaling
    out = dict(scaling, attention_factor=1.0)
    log_mul = meta_float(meta, "deepseek2.rope.scaling.yarn_log_multiplier", 0.0)
    if log_mul:
        out["mscale"] = out["mscale_all_dim"] = round(log_mul / 0.1, 6)
    return out


def _deepseek2_routing(meta: dict[str, Any], config: dict[str, Any], tensors: Mapping[str, TensorInfo],
                       sigmoid: bool) -> dict[str, Any]:
    """The MoE fields, checked against the file's tensors: the sparse layers (those with a router)
    follow leading_dense_block_count, and the correction bias is there exactly with sigmoid gating."""
    p = "deepseek2."
    layers = config["num_hidden_layers"]
    dense = meta_int(meta, p + "leading_dense_block_count")
    sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    if sparse != list(range(dense, layers)):
        raise CheckpointError(f"GGUF metadata {p}leading_dense_block_count={dense} but the layers with a router "
                              f"(ffn_gate_inp) are {sparse}")
    biased = [i for i in sparse if f"blk.{i}.exp_probs_b.bias" in tensors]
    norm = bool(meta.get(p + "expert_weights_norm", False))
    if sigmoid and biased != sparse:
        missing = next(i for i in sparse if i not in biased)
        raise CheckpointError(f"sigmoid expert gating (DeepSeek-V3) needs each router's correction bias; "
                              f"blk.{missing}.exp_probs_b.bias is missing")
    if not sigmoid and (biased or norm):
        what = "a correction bias (exp_probs_b)" if biased else f"{p}expert_weights_norm=true"
        raise CheckpointError(f"softmax expert gating (DeepSeek-V2) with {what} is not supported")
    groups = meta_int(meta, p + "expert_group_count", 1) or 1
    out: dict[str, Any] = {
        "n_routed_experts": meta_int(meta, p + "expert_count"),
        "num_experts_per_tok": meta_int(meta, p + "expert_used_count"),
        "moe_intermediate_size": meta_int(meta, p + "expert_feed_forward_length"),
        "n_shared_experts": meta_int(meta, p + "expert_shared_count", 0),
        "first_k_dense_replace": dense,
        "moe_layer_freq": 1,
        "routed_scaling_factor": meta_float(meta, p + "expert_weights_scale", 1.0) or 1.0,  # 0: llama.cpp does not scale
        "norm_topk_prob": norm,
        "n_group": groups,
        "topk_group": meta_int(meta, p + "expert_group_used_count", 1) or 1,
    }
    if not sigmoid:
        out["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    return out


def _gpt_oss_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    p = "gpt-oss."
    layers = config["num_hidden_layers"]
    window = meta_int(meta, p + "attention.sliding_window")
    width = meta_int(meta, p + "expert_feed_forward_length", config["intermediate_size"] or None)
    out: dict[str, Any] = {
        "num_local_experts": meta_int(meta, p + "expert_count"),
        "num_experts_per_tok": meta_int(meta, p + "expert_used_count"),
        "intermediate_size": width,
        "sliding_window": window,
        "layer_types": layer_types(meta, "gpt-oss", layers, window),
        "attention_bias": config["attention_bias"],
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
    }
    scaling = config["rope_scaling"]
    if scaling and scaling.get("rope_type") == "yarn":
        out["rope_scaling"] = dict(scaling, truncate=False)
    return out
