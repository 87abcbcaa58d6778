"""GGUF reader: the tokenizer built from a GGUF's vocabulary (byte-level BPE against one
trained with ``tokenizers``, special and user tokens, pre-tokenizer variants, SentencePiece
BPE against a spelled-out reference)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer

from ingot.loading.errors import CheckpointError
from ingot.loading.gguf import load_gguf
from tests.loading.gguf_fixtures import gpt2_vocab, write_gguf


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
