"""A ``tokenizers.Tokenizer`` built from a GGUF's tokenizer metadata.

A GGUF carries its vocabulary, merges and token types as llama.cpp metadata
rather than a tokenizer.json; this rebuilds the HF fast tokenizer that splits
text the way llama.cpp does, for the byte-level (gpt2) and SentencePiece
(llama) vocabularies.
"""

from __future__ import annotations

from typing import Any, Optional

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from ingot.loading.errors import CheckpointError

# token_type values in tokenizer.ggml.token_type (llama.cpp's llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

# Split regexes by tokenizer.ggml.pre, as the model's tokenizer.json uses them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# pre name -> (split regex or None for GPT-2's built-in one, digits split one by one first, ignore_merges)
_PRE_TOKENIZERS: dict[str, tuple[Optional[str], bool, bool]] = {
    "default": (None, False, False),
    "gpt-2": (None, False, False),
    "gpt2": (None, False, False),
    "smollm": (None, True, False),
    "starcoder": (None, True, False),
    "refact": (None, True, False),
    "llama-bpe": (_LLAMA3_SPLIT, False, True),
    "llama3": (_LLAMA3_SPLIT, False, True),
    "llama-v3": (_LLAMA3_SPLIT, False, True),
    "smaug-bpe": (_LLAMA3_SPLIT, False, True),
    "qwen2": (_QWEN2_SPLIT, False, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False, False),
    "tekken": (_TEKKEN_SPLIT, False, True),
}


def default_add_bos(meta: dict[str, Any]) -> bool:
    """llama.cpp's default when the file has no tokenizer.ggml.add_bos_token."""
    if meta.get("tokenizer.ggml.model") == "llama":
        return True
    return meta.get("tokenizer.ggml.pre") in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "tekken")


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """A HF fast tokenizer equivalent to llama.cpp's for this vocabulary; adds no BOS/EOS itself."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise CheckpointError("the GGUF has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a few files repeat a token; the first id wins
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(meta, vocab)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(meta, tokens, types, vocab)
    else:
        raise CheckpointError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")
    # Control/unknown tokens are special (skipped when decoding); user-defined ones are
    # plain added tokens. Either way they are matched whole, never split.
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (_CONTROL, _UNKNOWN) and t]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t]
    )
    return tokenizer


def _byte_level_bpe(meta: dict[str, Any], vocab: dict[str, int]) -> Tokenizer:
    """GPT-2 style byte-level BPE; tokens and merges are stored in the byte alphabet already."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise CheckpointError(
            f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    split, digits, ignore_merges = _PRE_TOKENIZERS[pre]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    steps: list[pre_tokenizers.PreTokenizer] = []
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], types: list[int], vocab: dict[str, int]) -> Tokenizer:
    """SentencePiece BPE (Llama 1/2, Mistral v0.x): merge by score, '▁' for spaces, byte fallback.

    SentencePiece merges the adjacent pair whose joined piece scores highest; a
    BPE merge list ranked by that score does the same. The space prefix is a
    normalizer, so like llama.cpp it also applies after each special token.
    """
    scores: list[float] = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
    ranked = []
    for i, (tok, ty) in enumerate(zip(tokens, types)):
        if ty != _NORMAL or len(tok) < 2 or vocab[tok] != i:
            continue
        for cut in range(1, len(tok)):
            if tok[:cut] in vocab and tok[cut:] in vocab:
                ranked.append((-scores[i], i, cut))
    ranked.sort()
    merges = [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in ranked]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps: list[normalizers.Normalizer] = [normalizers.Prepend("▁")] if space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    dec: list[decoders.Decoder] = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return tok
