"""GGUF files (llama.cpp's one-file format) turned into what ingot consumes.

A GGUF holds the config, the tokenizer and the (often quantized) weights in one
file, all named the llama.cpp way. ``load_gguf`` maps them to an HF-style
config dict, a ``tokenizers.Tokenizer`` and a lazy iterator of HF-named tensors,
so the model code never sees the format. Tensors are dequantized with
``gguf.quants``, except with ``weights(..., dequantize=False)``, where the
projections stored quantized come out in the canonical int form (``gguf_quant``,
described by ``quant``; experts stacked in one tensor split into per-expert
modules; the shards of one projection ingot holds as one in one form).

This module owns the llama.cpp -> HF mapping (architectures, metadata keys,
tensor names, q/k row order); the container is read by ``gguf_file`` and the
tokenizer rebuilt by ``gguf_tokenizer``.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
from tokenizers import Tokenizer

from ingot.loading.errors import CheckpointError
from ingot.loading.gguf_families import (
    FAMILY_ARCHITECTURES,
    NORM_PLUS_ONE,
    PARTIAL_ROTARY,
    block_overrides,
    family_config,
)
from ingot.loading.gguf_families import meta_int as _meta_int
from ingot.loading.gguf_file import (
    SUPPORTED_QUANT_TYPES,
    GGUFFormatError,
    TensorInfo,
    check_supported,
    map_file,
    read_header,
    read_raw_blocks,
    read_tensor,
)
from ingot.loading.gguf_quant import NATIVE_FORMS, Form, blocks_to_canonical, common_form, native_form
from ingot.loading.gguf_tokenizer import build_tokenizer, default_add_bos
from ingot.loading.quant_pack import canonical_names
from ingot.loading.quant_scheme import LinearScheme, QuantConfig
from ingot.loading.weights import WeightSelector, select as select_part

log = logging.getLogger(__name__)

__all__ = ["GGUFCheckpoint", "load_gguf", "CheckpointError", "SUPPORTED_QUANT_TYPES"]

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # MixtralForCausalLM when the file has experts
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    **FAMILY_ARCHITECTURES,
}
# llama.cpp renormalises the top-k routing weights per architecture unless the file says
# otherwise ({arch}.expert_weights_norm): Mixtral and Qwen3-MoE yes, Qwen2-MoE no
_NORM_TOPK = {"llama": True, "qwen3moe": True, "qwen2moe": False}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    # OLMo 2: norms on the sublayer outputs
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    # mixture of experts: the router, each projection of all experts stacked [E, ...], the shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# early Mixtral GGUFs: one tensor per expert, blk.N.ffn_gate.E.weight
_PER_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
# Tensors with no HF parameter that are safe to drop: rope_freqs and Phi-3's rope_factors_* become
# config["rope_scaling"]; attn_rot_embd is an old precomputed rotary table.
_SKIPPED = re.compile(r"^(rope_freqs\.weight|rope_factors_(long|short)\.weight|blk\.\d+\.attn_rot_embd(\.weight)?)$")
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# the projections (last part of the HF module name) whose blocks stay quantized
_PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
# the projection tensors the models hold as one (one scheme): q/k/v, gate/up, all routed experts of a layer
_HELD_AS_ONE = (
    (re.compile(r"^(.*\.experts)\.(?:\d+\.)?(?:gate|up|down)_proj\.weight$"), r"\1"),
    (re.compile(r"^(.*)\.[qkv]_proj\.weight$"), r"\1.qkv_proj"),
    (re.compile(r"^(.*)\.(?:gate|up)_proj\.weight$"), r"\1.gate_up_proj"),
)


@dataclass
class GGUFCheckpoint:
    """Everything ingot needs from one .gguf file; weights stay on disk until iterated."""

    config: dict[str, Any]
    tokenizer: Tokenizer
    chat_template: Optional[str]
    bos_token_id: Optional[int]
    eos_token_ids: list[int]
    add_bos_token: bool
    path: Path
    _buf: mmap.mmap = field(repr=False)
    _tensors: list[tuple[str, TensorInfo, int]] = field(repr=False)  # (hf name, info, heads to un-permute)
    _plus_one: frozenset[str] = field(default=frozenset(), repr=False)  # HF names stored as 1 + w (Gemma norms)

    @property
    def quant(self) -> Optional[QuantConfig]:
        """The projections served in the canonical int form (per module), None when none is."""
        per_module: dict[str, Optional[LinearScheme]] = {}
        forms = self._forms()
        for hf_name, info, _ in self._tensors:
            if _is_projection(hf_name):
                form = forms.get(hf_name)
                for module in _modules(hf_name, info):
                    per_module[module] = None if form is None else form.scheme
        if not any(s is not None for s in per_module.values()):
            return None
        return QuantConfig("gguf", None, ("lm_head",), per_module)

    @property
    def has_quantized(self) -> bool:
        """Whether some projection is stored in a type served quantized (``quant`` is not None, or raises)."""
        return any(_quantizable(hf_name, info) and native_form(info.qtype) for hf_name, info, _ in self._tensors)

    def _forms(self) -> dict[str, Form]:
        """HF tensor name -> the form it is served in, for the projections served quantized: its
        type's own, or, where the shards of a projection held as one differ, ``common_form``'s.
        Raises CheckpointError where such a projection mixes types served quantized and others."""
        groups: dict[str, list[tuple[str, TensorInfo]]] = {}
        for hf_name, info, _ in self._tensors:
            if _quantizable(hf_name, info):
                groups.setdefault(_held_as_one(hf_name), []).append((hf_name, info))
        forms: dict[str, Form] = {}
        for group, members in groups.items():
            form = common_form({info.qtype for _, info in members})
            quantized = [info for _, info in members if native_form(info.qtype)]
            if form is None and quantized:
                other = next(info for _, info in members if not native_form(info.qtype))
                raise CheckpointError(
                    f"tensor {other.name!r} is {other.qtype.name} but {quantized[0].name!r} is "
                    f"{quantized[0].qtype.name}: ingot holds {group.removeprefix('model.')} as one projection, served "
                    f"quantized only when every part is one of {', '.join(t.name for t in NATIVE_FORMS)} (load it "
                    "dequantized instead)")
            forms.update((hf_name, form) for hf_name, _ in members if form is not None)
        return forms

    @property
    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> shape, without reading any weight."""
        return {hf_name: info.shape for hf_name, info, _ in self._tensors}

    @property
    def num_tensors(self) -> int:
        return len(self._tensors)

    def tensor_count(self, dequantize: bool = True) -> int:
        """The tensors ``weights`` yields (``dequantize``: one per file tensor)."""
        total, forms = 0, {} if dequantize else self._forms()
        for hf_name, info, _ in self._tensors:
            form = forms.get(hf_name)
            total += 1 if form is None else len(canonical_names(form.scheme)) * len(_modules(hf_name, info))
        return total

    def weights(self, dtype: torch.dtype, select: Optional[WeightSelector] = None,
                dequantize: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) one at a time, so peak memory stays at one tensor; with ``select``,
        each tensor is read whole, then cut to the part it names. Every tensor comes in
        ``dtype``, except, without ``dequantize``, the projections served quantized: their
        canonical int tensors (``quant``)."""
        forms = {} if dequantize else self._forms()
        for hf_name, info, heads in self._tensors:
            form = forms.get(hf_name)
            if form is not None:
                yield from self._canonical(hf_name, info, heads, select, form)
                continue
            tensor = read_tensor(self._buf, info)
            if heads:
                tensor = _unpermute_rows(tensor, heads)
            if hf_name in self._plus_one:
                tensor = tensor.float() - 1.0
            if hf_name.endswith("shared_expert_gate.weight") and tensor.dim() == 1:
                tensor = tensor[None]  # llama.cpp may store the [1, H] gate as [H]
            yield hf_name, select_part(tensor, hf_name, select).to(dtype)

    def _canonical(self, hf_name: str, info: TensorInfo, heads: int, select: Optional[WeightSelector],
                   form: Form) -> Iterator[tuple[str, torch.Tensor]]:
        raw = read_raw_blocks(self._buf, info)
        experts = raw if raw.dim() == 3 else raw[None]
        for module, blocks in zip(_modules(hf_name, info), experts):
            for part, tensor in blocks_to_canonical(blocks, info.qtype, form).items():
                if heads:
                    tensor = _unpermute_rows(tensor, heads)
                name = f"{module}.{part}"
                yield name, select_part(tensor, name, select)


def load_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
    """Open a .gguf file: parse and check its header, build config and tokenizer.

    Every problem a model file can have (missing, truncated, not GGUF, an
    architecture, tensor or quantization ingot does not support) is raised here
    as a CheckpointError naming the file, before any weight is read.
    """
    path = Path(path)
    buf = map_file(path)
    try:
        return _open(path, buf)
    except GGUFFormatError as exc:
        raise CheckpointError(f"{path} is not a valid GGUF file: {exc}") from None
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    except (TypeError, ValueError, KeyError, IndexError) as exc:  # metadata of the wrong type or shape
        raise CheckpointError(f"{path}: bad GGUF metadata: {type(exc).__name__}: {exc}") from None


def _open(path: Path, buf: mmap.mmap) -> GGUFCheckpoint:
    meta, tensors = read_header(buf)
    by_name = {t.name: t for t in tensors}
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise CheckpointError(f"unsupported architecture {arch!r} (supported: {', '.join(sorted(_ARCHITECTURES))})")
    config = _config(meta, arch, by_name, buf)

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    overrides = block_overrides(arch, by_name)
    plan: list[tuple[str, TensorInfo, int]] = []
    unknown: list[str] = []
    for info in tensors:
        hf_name = _hf_name(info.name, overrides)
        if hf_name is None:
            if _SKIPPED.match(info.name):
                log.debug("gguf: skipping %s (no HF parameter)", info.name)
            else:
                unknown.append(info.name)
            continue
        check_supported(info)
        # llama.cpp's llama converter interleaves the rotary halves of q/k rows; qwen's does not.
        n_heads = heads.get(info.name.split(".")[-2], 0) if arch == "llama" else 0
        if n_heads and info.shape[0] % (2 * n_heads):
            raise CheckpointError(f"tensor {info.name!r} has {info.shape[0]} rows, not a multiple of 2 x {n_heads} heads")
        plan.append((hf_name, info, n_heads))
    if unknown:
        raise CheckpointError(f"tensors with no known HF equivalent: {', '.join(unknown[:8])}")

    try:
        tokenizer = build_tokenizer(meta)
    except CheckpointError:
        raise
    except Exception as exc:  # tokenizers raises bare Exceptions on bad vocab/merges
        raise CheckpointError(f"cannot build the tokenizer from the GGUF metadata: {exc}") from None
    eos_ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta]
    return GGUFCheckpoint(
        config=config,
        tokenizer=tokenizer,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(int(i) for i in eos_ids)),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos(meta))),
        path=path,
        _buf=buf,
        _tensors=plan,
        _plus_one=frozenset(n for n, info, _ in plan if arch in NORM_PLUS_ONE and info.name.endswith("norm.weight")),
    )


# ---------------------------------------------------------------- names


def _unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (per head: rotary halves interleaved) back to HF's.

    The converter does ``w.reshape(n_heads, 2, d // 2, ...).swapaxes(1, 2)``; the
    inverse splits each head into (d // 2, 2) and swaps back. Biases too: they
    must follow the rows of their weight.
    """
    rest = w.shape[1:]
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


def _is_projection(hf_name: str) -> bool:
    module, _, kind = hf_name.rpartition(".")
    return kind == "weight" and module.rpartition(".")[2] in _PROJECTIONS


def _quantizable(hf_name: str, info: TensorInfo) -> bool:
    """Whether the tensor is a projection's weight (one, or stacked experts), which may be served quantized."""
    return _is_projection(hf_name) and len(info.shape) in (2, 3)


def _held_as_one(hf_name: str) -> str:
    """The projection the models hold a projection tensor in (several tensors share some)."""
    for pattern, group in _HELD_AS_ONE:
        if pattern.match(hf_name):
            return pattern.sub(group, hf_name)
    return hf_name.rpartition(".")[0]


def _modules(hf_name: str, info: TensorInfo) -> list[str]:
    """The HF modules of a projection tensor: itself, or one per expert of a stacked [E, N, K] tensor."""
    module = hf_name.rpartition(".")[0]
    if len(info.shape) != 3:
        return [module]
    head, _, proj = module.rpartition(".")
    return [f"{head}.{e}.{proj}" for e in range(info.shape[0])]


def _hf_name(name: str, overrides: dict[str, str]) -> Optional[str]:
    """The HF parameter name of a llama.cpp tensor name, None when it has none (skipped or unknown);
    ``overrides``: the family's own block names."""
    if (m := _PER_EXPERT_TENSOR.match(name)) is not None:
        layer, proj, expert = m.groups()
        return f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"
    if (m := _BLOCK_TENSOR.match(name)) is not None:
        layer, base, kind = m.groups()
        names = {**_BLOCK_NAMES, **overrides}
        return f"model.layers.{layer}.{names[base]}.{kind}" if base in names else None
    base, _, kind = name.rpartition(".")
    if base in _GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    return None


# ---------------------------------------------------------------- config


def _config(meta: dict[str, Any], arch: str, tensors: dict[str, TensorInfo], buf: mmap.mmap) -> dict[str, Any]:
    """llama.cpp metadata keys -> an HF config.json dict."""
    p = arch + "."
    hidden = _meta_int(meta, p + "embedding_length")
    heads = _meta_int(meta, p + "attention.head_count")
    kv_heads = _meta_int(meta, p + "attention.head_count_kv", heads)
    head_dim = _meta_int(meta, p + "attention.key_length", hidden // heads)
    rot_dim = _meta_int(meta, p + "rope.dimension_count", head_dim)
    if rot_dim != head_dim and arch not in PARTIAL_ROTARY:
        raise CheckpointError(f"partial rotary embeddings ({rot_dim} of {head_dim} dims) are not supported")
    theta = float(meta.get(p + "rope.freq_base", 10000.0))
    if p + "vocab_size" in meta:
        vocab = _meta_int(meta, p + "vocab_size")
    elif "token_embd.weight" in tensors:
        vocab = tensors["token_embd.weight"].shape[0]
    else:
        vocab = len(meta.get("tokenizer.ggml.tokens", ()))
    config = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": _meta_int(meta, p + "feed_forward_length", 0 if arch.endswith("moe") else None),
        "num_hidden_layers": _meta_int(meta, p + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(meta, p, tensors, buf, theta, head_dim),
        "max_position_embeddings": _meta_int(meta, p + "context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    config.update(_moe_config(meta, arch, tensors))
    config.update(family_config(meta, arch, config, tensors, lambda name: read_tensor(buf, tensors[name])))
    return config


def _moe_config(meta: dict[str, Any], arch: str, tensors: dict[str, TensorInfo]) -> dict[str, Any]:
    """The HF MoE fields of a GGUF with experts ({} without): counts, widths, routing, dense layers."""
    p = arch + "."
    experts = _meta_int(meta, p + "expert_count", 0)
    if not experts:
        if arch.endswith("moe"):
            raise CheckpointError(f"{arch} GGUF metadata has no {p}expert_count")
        return {}
    if arch not in _NORM_TOPK:
        raise CheckpointError(f"mixture-of-experts {arch} GGUFs are not supported")
    out: dict[str, Any] = {
        "num_experts_per_tok": _meta_int(meta, p + "expert_used_count"),
        "norm_topk_prob": bool(meta.get(p + "expert_weights_norm", _NORM_TOPK[arch])),
    }
    if arch == "llama":  # Mixtral: feed_forward_length is the expert width
        out["architectures"] = ["MixtralForCausalLM"]
        out["num_local_experts"] = experts
        return out
    out["num_experts"] = experts
    out["moe_intermediate_size"] = _meta_int(meta, p + "expert_feed_forward_length")
    layers = _meta_int(meta, p + "block_count")
    shared = [tensors[n] for i in range(layers) if (n := f"blk.{i}.ffn_gate_shexp.weight") in tensors]
    if shared:
        out["shared_expert_intermediate_size"] = _meta_int(meta, p + "expert_shared_feed_forward_length", shared[0].shape[0])
    out["mlp_only_layers"] = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    return out


def _rope_scaling(
    meta: dict[str, Any], p: str, tensors: dict[str, TensorInfo], buf: mmap.mmap, theta: float, head_dim: int
) -> Optional[dict[str, Any]]:
    kind = meta.get(p + "rope.scaling.type")
    factor = meta.get(p + "rope.scaling.factor", meta.get(p + "rope.scale_linear"))
    if kind is None and factor is not None:
        kind = "linear"  # old files: rope.scale_linear only
    if kind in ("linear", "yarn") and factor is not None and float(factor) != 1.0:
        out: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        if kind == "yarn":
            out["original_max_position_embeddings"] = _meta_int(meta, p + "rope.scaling.original_context_length")
        return out
    if kind not in (None, "none", "linear", "yarn"):
        raise CheckpointError(f"unsupported rope scaling type {kind!r} in GGUF metadata")
    if "rope_freqs.weight" in tensors:
        return _llama3_from_freqs(read_tensor(buf, tensors["rope_freqs.weight"]).float().numpy(), theta, head_dim)
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
