"""A ``tokenizers.Tokenizer`` built from a GGUF's tokenizer metadata.

A GGUF carries its vocabulary, merges and token types as llama.cpp metadata
rather than a tokenizer.json; this rebuilds the HF fast tokenizer that splits
text the way the model's own tokenizer does, for the byte-level (gpt2)
vocabularies with the split rule tokenizer.ggml.pre names
(``gguf_pre_tokenizers``) and the SentencePiece (llama) ones.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

from ingot.loading.errors import CheckpointError
from ingot.loading.gguf_pre_tokenizers import PRE_TOKENIZERS, build_pre_tokenizer, pre_tokenizer_rule

# token_type values in tokenizer.ggml.token_type (llama.cpp's llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4


def default_add_bos(meta: dict[str, Any]) -> bool:
    """llama.cpp's default when the file has no tokenizer.ggml.add_bos_token."""
    if meta.get("tokenizer.ggml.model") == "llama":
        return True
    rule = PRE_TOKENIZERS.get(meta.get("tokenizer.ggml.pre", "default"))
    return rule is not None and rule.add_bos


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """A HF fast tokenizer that tokenizes this vocabulary as the model's own does; adds no BOS/EOS itself."""
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
    rule = pre_tokenizer_rule(meta.get("tokenizer.ggml.pre", "default"))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=rule.ignore_merges))
    tok.pre_tokenizer = build_pre_tokenizer(rule)
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
