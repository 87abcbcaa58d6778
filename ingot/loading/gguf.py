"""GGUF files (llama.cpp's one-file format) turned into what ingot consumes.

A GGUF holds the config, the tokenizer and the (often quantized) weights in one
file, all named the llama.cpp way. ``load_gguf`` maps them to an HF-style
config dict, a ``tokenizers.Tokenizer`` and a lazy iterator of HF-named tensors,
so the model code never sees the format. Tensors are dequantized with
``gguf.quants``, except with ``weights(..., dequantize=False)``, where the
projections stored quantized come out in a canonical form (``gguf_quant``,
described by ``quant``; experts stacked in one tensor split into per-expert
modules; the shards of one projection ingot holds as one in one form), except the
modules the model holds in the model dtype (``held_dense``) and deepseek2's ``kv_b_proj``
joined from ``attn_k_b`` / ``attn_v_b`` (``attn_k_b`` is stored transposed, its blocks
running along what are ``kv_b_proj``'s rows), which come dequantized.

This module owns the llama.cpp -> HF tensor mapping (names, q/k row order, tensors
joined or split); the config is built by ``gguf_config`` (with the per-family rules of
``gguf_families`` and ``gguf_moe_families``), the container read by ``gguf_file`` and the
tokenizer rebuilt by ``gguf_tokenizer``.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from tokenizers import Tokenizer

from ingot.loading.errors import CheckpointError
from ingot.loading.gguf_config import ARCHITECTURES, hf_config
from ingot.loading.gguf_families import NORM_PLUS_ONE, block_overrides
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
from ingot.loading.gguf_moe_families import Join, join_kv_b, kv_b_joins, moe_block_names
from ingot.loading.gguf_quant import NATIVE_FORMS, Form, blocks_to_canonical, common_form, native_form
from ingot.loading.gguf_tokenizer import build_tokenizer, default_add_bos
from ingot.loading.quant_pack import canonical_names
from ingot.loading.quant_scheme import LinearScheme, QuantConfig, module_matches
from ingot.loading.weights import WeightSelector, select as select_part

log = logging.getLogger(__name__)

__all__ = ["GGUFCheckpoint", "load_gguf", "CheckpointError", "SUPPORTED_QUANT_TYPES"]

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
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",  # the converter's --fuse-gate-up-exps: gate rows, then up rows
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# tensors whose HF parameter has no .weight / .bias suffix
_BARE_PARAMETERS = {"attn_sinks": "self_attn.sinks", "exp_probs_b": "mlp.gate.e_score_correction_bias"}
# early Mixtral GGUFs: one tensor per expert, blk.N.ffn_gate.E.weight
_PER_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
# Tensors with no HF parameter that are safe to drop: rope_freqs and Phi-3's rope_factors_* become
# config["rope_scaling"]; attn_rot_embd is an old precomputed rotary table.
_SKIPPED = re.compile(r"^(rope_freqs\.weight|rope_factors_(long|short)\.weight|blk\.\d+\.attn_rot_embd(\.weight)?)$")
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# the projections (last part of the HF module name) whose blocks stay quantized (deepseek2's
# latent attention: q_a / q_b / kv_a / kv_b)
_PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                          "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"})
# the projection tensors the models hold as one (one scheme): q/k/v (deepseek2: q or q_a with kv_a),
# gate/up, all routed experts of a layer
_HELD_AS_ONE = (
    (re.compile(r"^(.*\.experts)\.(?:\d+\.)?(?:gate_up|gate|up|down)_proj\.weight$"), r"\1"),
    (re.compile(r"^(.*)\.(?:[qkv]_proj|q_a_proj|kv_a_proj_with_mqa)\.weight$"), r"\1.qkv_proj"),
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
    _joins: dict[str, Join] = field(default_factory=dict, repr=False)  # HF name -> the file tensor read with its own
    # modules the model holds in the model dtype (patterns as in QuantConfig.ignore): dequantized at load
    held_dense: tuple[str, ...] = ()

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
        """Whether some projection is stored in a type ingot serves quantized (the file's quantization
        method is then ``gguf``; ``quant`` may still be None where only held-dense ones are)."""
        return any(_quantizable(hf_name, info) and native_form(info.qtype) for hf_name, info, _ in self._tensors)

    def _forms(self) -> dict[str, Form]:
        """HF tensor name -> the form it is served in, for the projections served quantized: its
        type's own, or, where the shards of a projection held as one differ, ``common_form``'s.
        Raises CheckpointError where such a projection mixes types served quantized and others."""
        groups: dict[str, list[tuple[str, TensorInfo]]] = {}
        for hf_name, info, _ in self._tensors:
            if (_quantizable(hf_name, info) and hf_name not in self._joins
                    and not module_matches(hf_name.rpartition(".")[0], self.held_dense)):
                groups.setdefault(_held_as_one(hf_name), []).append((hf_name, info))
        forms: dict[str, Form] = {}
        for group, members in groups.items():
            form = common_form({info.qtype for _, info in members})
            quantized = [info for _, info in members if native_form(info.qtype)]
            if form is None and quantized:
                other = next((info for _, info in members if not native_form(info.qtype)), None) or next(
                    info for _, info in members if info.qtype != quantized[0].qtype)  # MXFP4 with another type
                raise CheckpointError(
                    f"tensor {other.name!r} is {other.qtype.name} but {quantized[0].name!r} is "
                    f"{quantized[0].qtype.name}: ingot holds {group.removeprefix('model.')} as one projection, served "
                    f"quantized only when its parts share one form (types {', '.join(t.name for t in NATIVE_FORMS)}; "
                    "MXFP4 alone) (load it dequantized instead)")
            forms.update((hf_name, form) for hf_name, _ in members if form is not None)
        return forms

    @property
    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> shape, without reading any weight."""
        return {hf_name: self._joins[hf_name].shape if hf_name in self._joins else info.shape
                for hf_name, info, _ in self._tensors}

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
            if hf_name in self._joins:
                tensor = join_kv_b(tensor, read_tensor(self._buf, self._joins[hf_name].second))
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
        modules = iter(_modules(hf_name, info))
        halves = (0, 1) if _is_gate_up(hf_name) else (None,)  # a fused gate_up expert: its gate rows, then its up rows
        for blocks in experts:
            canonical = blocks_to_canonical(blocks, info.qtype, form)
            for rows in halves:
                module = next(modules)
                for part, tensor in canonical.items():
                    if rows is not None:
                        tensor = tensor.chunk(2, dim=0)[rows].contiguous()
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
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"unsupported architecture {arch!r} (supported: {', '.join(sorted(ARCHITECTURES))})")
    config = hf_config(meta, arch, by_name, lambda name: read_tensor(buf, by_name[name]))

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    overrides = {**block_overrides(arch, by_name), **moe_block_names(arch)}
    joins, superseded = kv_b_joins(arch, by_name)
    second_parts = {join.second.name for join in joins.values()}
    plan: list[tuple[str, TensorInfo, int]] = []
    unknown: list[str] = []
    for info in tensors:
        if info.name in second_parts:  # read with its first part
            check_supported(info)
            continue
        hf_name = None if info.name in superseded else _hf_name(info.name, overrides)
        if hf_name is None:
            if _SKIPPED.match(info.name) or info.name in superseded:
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
        _joins={hf_name: joins[info.name] for hf_name, info, _ in plan if info.name in joins},
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
    return kind == "weight" and (module.rpartition(".")[2] in _PROJECTIONS or _is_gate_up(hf_name))


def _is_gate_up(hf_name: str) -> bool:
    """Whether the tensor is the routed experts' gate and up stacked as one (``ffn_gate_up_exps``)."""
    return hf_name.endswith(".experts.gate_up_proj.weight")


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
    """The HF modules of a projection tensor: itself, or one per expert of a stacked [E, N, K]
    tensor (two, its gate_proj and up_proj, of a fused gate_up one)."""
    module = hf_name.rpartition(".")[0]
    if len(info.shape) != 3:
        return [module]
    head, _, proj = module.rpartition(".")
    projections = ("gate_proj", "up_proj") if _is_gate_up(hf_name) else (proj,)
    return [f"{head}.{e}.{p}" for e in range(info.shape[0]) for p in projections]


def _hf_name(name: str, overrides: dict[str, str]) -> Optional[str]:
    """The HF parameter name of a llama.cpp tensor name, None when it has none (skipped or unknown);
    ``overrides``: the family's own block names."""
    if (m := _PER_EXPERT_TENSOR.match(name)) is not None:
        layer, proj, expert = m.groups()
        return f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"
    if (m := _BLOCK_TENSOR.match(name)) is not None:
        layer, base, kind = m.groups()
        if base in _BARE_PARAMETERS:
            return f"model.layers.{layer}.{_BARE_PARAMETERS[base]}"
        names = {**_BLOCK_NAMES, **overrides}
        return f"model.layers.{layer}.{names[base]}.{kind}" if base in names else None
    base, _, kind = name.rpartition(".")
    if base in _GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    return None
