"""Tiny GGUFs for the GGUF reader's tests: written with gguf.GGUFWriter (hyper-parameters,
a byte-level vocabulary, tensors), and tiny Llama-shaped state dicts named and permuted the
way llama.cpp's converter does."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import gguf
import numpy as np
import torch

from ingot.loading.gguf import GGUFCheckpoint

RNG = np.random.default_rng(0)


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte (byte-level BPE vocabularies spell tokens with it)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


HP = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, layers=2)


def gpt2_vocab() -> tuple[list[str], list[int], list[str]]:
    """A tiny byte-level vocabulary: the 256 byte symbols, two merges, a control and a user token."""
    tokens = ["<|endoftext|>", *byte_alphabet(), "Ġt", "he", "<think>"]
    types = [3, *[1] * 256, 1, 1, 4]
    return tokens, types, ["Ġ t", "h e"]


def write_gguf(
    path: Path,
    arch: str = "llama",
    tensors: Optional[dict[str, Any]] = None,
    meta: Optional[Callable[[gguf.GGUFWriter], None]] = None,
    hparams: bool = True,
    tokenizer: bool = True,
) -> Path:
    """Write a GGUF: tensors are float arrays (HF shape) or (raw uint8 rows, qtype) pairs."""
    w = gguf.GGUFWriter(str(path), arch)
    if hparams:
        w.add_uint32(f"{arch}.block_count", HP["layers"])
        w.add_uint32(f"{arch}.context_length", 256)
        w.add_uint32(f"{arch}.embedding_length", HP["hidden"])
        w.add_uint32(f"{arch}.feed_forward_length", HP["inter"])
        w.add_uint32(f"{arch}.attention.head_count", HP["heads"])
        w.add_uint32(f"{arch}.attention.head_count_kv", HP["kv_heads"])
        w.add_float32(f"{arch}.rope.freq_base", 10000.0)
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    if tokenizer:
        tokens, types, merges = gpt2_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(0)
        w.add_eos_token_id(0)
    if meta is not None:
        meta(w)
    for name, value in (tensors or {}).items():
        if isinstance(value, tuple):
            w.add_tensor(name, value[0], raw_dtype=value[1])
        else:
            w.add_tensor(name, np.ascontiguousarray(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def weights(ckpt: GGUFCheckpoint, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return dict(ckpt.weights(dtype))


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_state_dict(*, bias: bool = False, qk_norm: bool = False, tied: bool = False, head_dim: int = 16) -> dict[str, np.ndarray]:
    h, nh, nkv, inter, vocab = HP["hidden"], HP["heads"], HP["kv_heads"], HP["inter"], len(gpt2_vocab()[0])
    r = lambda *s: RNG.standard_normal(s).astype(np.float32)  # noqa: E731
    sd = {"model.embed_tokens.weight": r(vocab, h), "model.norm.weight": r(h)}
    if not tied:
        sd["lm_head.weight"] = r(vocab, h)
    for i in range(HP["layers"]):
        p = f"model.layers.{i}."
        sd |= {
            p + "self_attn.q_proj.weight": r(nh * head_dim, h),
            p + "self_attn.k_proj.weight": r(nkv * head_dim, h),
            p + "self_attn.v_proj.weight": r(nkv * head_dim, h),
            p + "self_attn.o_proj.weight": r(h, nh * head_dim),
            p + "mlp.gate_proj.weight": r(inter, h),
            p + "mlp.up_proj.weight": r(inter, h),
            p + "mlp.down_proj.weight": r(h, inter),
            p + "input_layernorm.weight": r(h),
            p + "post_attention_layernorm.weight": r(h),
        }
        if bias:
            sd |= {p + f"self_attn.{x}_proj.bias": r(n * head_dim) for x, n in (("q", nh), ("k", nkv), ("v", nkv))}
        if qk_norm:
            sd |= {p + "self_attn.q_norm.weight": r(head_dim), p + "self_attn.k_norm.weight": r(head_dim)}
    return sd


TO_GGUF = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_name(name: str, table: dict[str, str]) -> str:
    """An HF tensor name as llama.cpp's converter names it (``table``: module path, within a
    layer or the model, -> GGUF stem; layers become ``blk.N``)."""
    stem, kind = name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, rest = stem.split(".", 3)
        return f"blk.{layer}.{table[rest]}.{kind}"
    return f"{table[stem]}.{kind}"


def to_gguf(sd: dict[str, np.ndarray], permute: bool) -> dict[str, np.ndarray]:
    """HF state dict -> GGUF tensors the way llama.cpp's converter names (and permutes) them."""
    out = {}
    for name, w in sd.items():
        gname = gguf_name(name, TO_GGUF)
        if permute and ("attn_q." in gname or "attn_k." in gname):
            w = llama_cpp_permute(w, HP["heads"] if "attn_q." in gname else HP["kv_heads"])
        out[gname] = w
    return out
