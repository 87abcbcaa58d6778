"""EAGLE head checkpoints: a directory (or hub id) with ``config.json`` and the head's weights
in ``model.safetensors`` or ``pytorch_model.bin``, as SafeAILab/EAGLE and SpecForge publish
them (the decoder layer as ``midlayer.*`` or ``layers.0.*``, with or without ``model.``),
or in the speculators library's layout (the layer's config under
``transformer_layer_config``, ``norm_before_residual``). The model itself: ``models/eagle.py``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from ingot.loading import hf
from ingot.loading.checkpoint import resolve
from ingot.loading.dummy import SHAPES, shape_config
from ingot.loading.errors import CheckpointError
from ingot.loading.model_config import ModelConfig

_PATTERNS = ["*.json", "*.safetensors", "*.bin"]


@dataclasses.dataclass(frozen=True)
class EagleSpec:
    """What a head's checkpoint says beyond its decoder layer."""

    variant: str  # "eagle" (EAGLE-1) or "eagle3"
    aux_layers: tuple[int, ...]  # EAGLE-3: the target layers whose input streams it reads; EAGLE-1: ()
    target_hidden_size: int
    draft_vocab_size: int  # rows of the head's lm_head (EAGLE-3); the target's vocabulary for EAGLE-1
    fc_bias: bool
    own_embedding: bool  # the checkpoint holds embed_tokens (else the target's are shared)
    own_lm_head: bool  # the checkpoint holds lm_head (else the target's is shared)
    has_d2t: bool
    norm_before_residual: bool = False  # EAGLE-3: the residual around the attention is the normed hidden state


@dataclasses.dataclass
class EagleCheckpoint:
    source: str
    config: ModelConfig  # the head's decoder layer; vocab_size the target's
    spec: EagleSpec
    tensors: dict[str, torch.Tensor]  # model names (``layers.0.*``, ``fc.*``, ``d2t`` ...)


def open_eagle_head(name: str, variant: str, target: ModelConfig) -> EagleCheckpoint:
    """The head ``name`` for ``target`` (a built-in shape's name: a random head with that
    shape's layer, for benchmarks); ``CheckpointError`` naming what does not fit."""
    if name in SHAPES:
        return random_head(name, variant, target)
    path = resolve(name, patterns=_PATTERNS)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"EAGLE head {path} has no config.json")
    raw = hf.read_json(path / "config.json")
    layer_cfg = dict(raw.get("transformer_layer_config") or raw)  # (the speculators library's layout)
    layer_cfg["architectures"] = ["LlamaForCausalLM"]  # the head's layer is a Llama layer whatever it drafts for
    for key in ("sliding_window", "layer_types", "use_sliding_window"):  # (copied from a target's config: the
        layer_cfg.pop(key, None)                                         # head attends to its whole context)
    layer_cfg.setdefault("vocab_size", target.vocab_size)
    cfg = ModelConfig.from_hf(layer_cfg)
    if cfg.num_layers != 1:
        raise CheckpointError(f"EAGLE head {path}: num_hidden_layers={cfg.num_layers}; ingot serves one-layer heads")
    tensors = _read_tensors(path)
    spec = _spec(raw, variant, cfg, target, tensors, path)
    if spec.own_embedding and tensors["embed_tokens.weight"].shape[0] != target.vocab_size:
        raise CheckpointError(f"EAGLE head {path}: its embed_tokens has {tensors['embed_tokens.weight'].shape[0]} "
                              f"rows, the target's vocabulary {target.vocab_size}")
    return EagleCheckpoint(str(path), dataclasses.replace(cfg, vocab_size=target.vocab_size), spec, tensors)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    if files:
        for file in files:
            try:
                out.update(safetensors.torch.load_file(str(file)))
            except Exception as exc:
                raise CheckpointError(f"EAGLE head {file}: corrupt or truncated safetensors file ({exc})") from None
    else:
        bins = sorted(path.glob("*.bin"))
        if not bins:
            raise CheckpointError(f"EAGLE head {path} has no model.safetensors or pytorch_model.bin")
        for file in bins:
            try:
                out.update(torch.load(file, map_location="cpu", weights_only=True))
            except Exception as exc:
                raise CheckpointError(f"EAGLE head {file}: not a readable PyTorch state dict ({exc})") from None
    renamed = {}
    for name, tensor in out.items():
        name = name.removeprefix("model.")
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        renamed[name] = tensor
    return renamed


def _spec(raw: dict[str, Any], variant: str, cfg: ModelConfig, target: ModelConfig, tensors: dict[str, torch.Tensor],
          path: Path) -> EagleSpec:
    h, th = cfg.hidden_size, int(raw.get("target_hidden_size") or target.hidden_size)
    if th != target.hidden_size:
        raise CheckpointError(f"EAGLE head {path} was trained for a target of hidden size {th}; this target's is "
                              f"{target.hidden_size}")
    fc = tensors.get("fc.weight")
    if fc is None or fc.dim() != 2 or fc.shape[0] != h:
        raise CheckpointError(f"EAGLE head {path} has no fc.weight of {h} rows (not an EAGLE head?)")
    looks3 = "layers.0.hidden_norm.weight" in tensors
    if variant == "eagle3" and not looks3:
        raise CheckpointError(f"{path} is not an EAGLE-3 head (no hidden_norm); use method 'eagle'")
    if variant == "eagle" and looks3:
        raise CheckpointError(f"{path} is an EAGLE-3 head (it has hidden_norm); use method 'eagle3'")
    own_embedding = "embed_tokens.weight" in tensors
    if variant == "eagle":
        if h != target.hidden_size or fc.shape[1] != 2 * h:
            raise CheckpointError(f"EAGLE-1 head {path}: fc must map 2 x {target.hidden_size} to {target.hidden_size} "
                                  f"(the target's hidden size), got {tuple(fc.shape)}")
        return EagleSpec("eagle", (), th, target.vocab_size, "fc.bias" in tensors, own_embedding, False, False)
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    n = target.num_layers
    aux = tuple(int(i) for i in ids) if ids else (2, n // 2, n - 3)
    if len(set(aux)) != len(aux) or not all(0 <= i < n for i in aux) or list(aux) != sorted(aux):
        raise CheckpointError(f"EAGLE-3 head {path}: its target layers {list(aux)} must be distinct, increasing and "
                              f"within the target's {n} layers")
    if fc.shape[1] != len(aux) * th:
        raise CheckpointError(f"EAGLE-3 head {path}: fc reads {fc.shape[1]} features, not {len(aux)} target layers "
                              f"x {th}")
    if not own_embedding and h != target.hidden_size:
        raise CheckpointError(f"EAGLE-3 head {path} has no embed_tokens and a hidden size ({h}) other than the "
                              f"target's ({target.hidden_size}), so it cannot share the target's")
    draft_vocab = int(raw.get("draft_vocab_size") or target.vocab_size)
    head = tensors.get("lm_head.weight")
    if head is None and (draft_vocab != target.vocab_size or h != target.hidden_size):
        raise CheckpointError(f"EAGLE-3 head {path} has no lm_head.weight")
    if head is not None and tuple(head.shape) != (draft_vocab, h):
        raise CheckpointError(f"EAGLE-3 head {path}: lm_head.weight is {tuple(head.shape)}, expected "
                              f"({draft_vocab}, {h}) (draft_vocab_size x hidden_size)")
    has_d2t = "d2t" in tensors
    if draft_vocab != target.vocab_size and not has_d2t:
        raise CheckpointError(f"EAGLE-3 head {path}: a draft vocabulary of {draft_vocab} ids needs d2t (its map to "
                              f"the target's {target.vocab_size})")
    if has_d2t:
        d2t = tensors["d2t"]
        if tuple(d2t.shape) != (draft_vocab,):
            raise CheckpointError(f"EAGLE-3 head {path}: d2t is {tuple(d2t.shape)}, expected ({draft_vocab},)")
        mapped = torch.arange(draft_vocab) + d2t.to(torch.int64)
        if int(mapped.min()) < 0 or int(mapped.max()) >= target.vocab_size or mapped.unique().numel() != draft_vocab:
            raise CheckpointError(f"EAGLE-3 head {path}: d2t maps its ids outside the target's vocabulary of "
                                  f"{target.vocab_size} or onto one id twice")
    return EagleSpec("eagle3", aux, th, draft_vocab, False, own_embedding, head is not None, has_d2t,
                     bool(raw.get("norm_before_residual", False)))


# EAGLE-3 heads published for Llama 3 targets draft over 32,000 ids
RANDOM_DRAFT_VOCAB = 32000


def random_head(shape: str, variant: str, target: ModelConfig, seed: int = 0) -> EagleCheckpoint:
    """A random head whose layer is shape ``shape``'s (its attention and MLP sizes, as the
    published heads take their target's), for ``target`` (which must share its hidden size);
    EAGLE-3 over the first ``RANDOM_DRAFT_VOCAB`` ids. Weights ~ N(0, 0.02), norms 1."""
    layer_cfg = {**shape_config(shape, target.vocab_size, 1), "architectures": ["LlamaForCausalLM"]}
    cfg = dataclasses.replace(ModelConfig.from_hf(layer_cfg), qkv_bias=False, o_bias=False)
    if cfg.hidden_size != target.hidden_size:
        raise CheckpointError(f"a random EAGLE head of shape {shape!r} has hidden size {cfg.hidden_size}, the target "
                              f"{target.hidden_size}")
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    eagle3 = variant == "eagle3"
    attn_in = 2 * h if eagle3 else h
    shapes = {"fc.weight": (h, 3 * h if eagle3 else 2 * h), "layers.0.self_attn.q_proj.weight": (q, attn_in),
              "layers.0.self_attn.k_proj.weight": (kv, attn_in), "layers.0.self_attn.v_proj.weight": (kv, attn_in),
              "layers.0.self_attn.o_proj.weight": (h, q), "layers.0.mlp.gate_proj.weight": (inter, h),
              "layers.0.mlp.up_proj.weight": (inter, h), "layers.0.mlp.down_proj.weight": (h, inter)}
    draft_vocab = min(RANDOM_DRAFT_VOCAB, target.vocab_size) if eagle3 else target.vocab_size
    if eagle3:
        shapes["lm_head.weight"] = (draft_vocab, h)
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(size, generator=gen) * 0.02 for name, size in shapes.items()}
    norms = ["layers.0.post_attention_layernorm.weight"]
    norms += ["layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight", "norm.weight"] if eagle3 else []
    tensors.update({name: torch.ones(h) for name in norms})
    n = target.num_layers
    aux = (2, n // 2, n - 3) if eagle3 else ()
    if eagle3:
        tensors["d2t"] = torch.zeros(draft_vocab, dtype=torch.int64)
    spec = EagleSpec(variant, aux, h, draft_vocab, False, False, eagle3, eagle3)
    return EagleCheckpoint(f"random {variant} head ({shape})", cfg, spec, tensors)
