"""The split rules a GGUF names in ``tokenizer.ggml.pre``, as HF ``tokenizers`` steps.

A byte-level BPE splits text into pieces before merging, and never merges across
two pieces. llama.cpp keeps each family's split rule in code (one list of regexes
per ``LLAMA_VOCAB_PRE_TYPE_*`` in src/llama-vocab.cpp) and a GGUF only names the
family. Each rule here is written the way that family's own tokenizer.json writes
it: Split regexes that isolate their matches, each applied in turn to the pieces
the one before left, then optionally every digit on its own, then ByteLevel.
Where llama.cpp's list differs from the tokenizer.json (``deepseek-llm`` splits
digit runs with ``\\p{N}+`` where the model's file isolates each digit), the
model's file wins: it is what the model was trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

from ingot.loading.errors import CheckpointError


@dataclass(frozen=True)
class PreTokenizerRule:
    """One family's pre-tokenizer and the BPE options llama.cpp sets with it."""

    splits: tuple[str, ...] = ()  # Split(Regex, "isolated"), in order
    digits: bool = False  # then Digits(individual_digits=True)
    gpt2_regex: bool = False  # ByteLevel splits with GPT-2's own regex (use_regex=True)
    ignore_merges: bool = False  # a piece that is a whole vocabulary token is kept whole
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


# Llama 3 / cl100k (tiktoken's GPT-4 regex): digits in runs of up to three.
_CL100K = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2: cl100k with every digit its own piece.
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's tekken: words split at lower -> upper case changes, no contractions.
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (GPT-4o, gpt-oss): tekken's case-split words with contractions attached, digit runs of three.
_O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# DeepSeek LLM / V2 and DeepSeek Coder: newlines alone, words and punctuation runs with
# one leading space, Han / CJK / Hangul runs, every digit alone. The letter class is
# the cased letters (Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee, Glagolitic,
# Coptic, Deseret, Osage, Old Hungarian, Warang Citi, Adlam, ...), spelled as code
# points because several of them (U+1F7D, U+1FBE, U+2126, U+212A, ...) are changed by
# Unicode normalization wherever the text is copied as characters.
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134"
    "\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943"
)
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[" + _DEEPSEEK_LETTERS + "]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    _DEEPSEEK_CJK,
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK)
# DeepSeek-V3 / R1: digit runs of three, Han and kana runs, then a cl100k-like rule
# where one ASCII punctuation mark may lead an ASCII word.
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

_GPT2 = PreTokenizerRule(gpt2_regex=True)
_GPT2_DIGITS = PreTokenizerRule(digits=True, gpt2_regex=True)
_LLAMA3 = PreTokenizerRule((_CL100K,), ignore_merges=True, add_bos=True)

# tokenizer.ggml.pre -> rule. Names as convert_hf_to_gguf.py writes them; ignore_merges
# and add_bos as llama.cpp sets them per name ("smaug-bpe" and "dbrx", the cl100k files
# of Smaug, DBRX and the models sharing that vocabulary, set neither). "default" (no
# family recognized) is read as GPT-2's rule.
PRE_TOKENIZERS: dict[str, PreTokenizerRule] = {
    "default": _GPT2,
    "gpt-2": _GPT2,
    "gpt2": _GPT2,
    "phi-2": _GPT2,
    "olmo": _GPT2,
    "mpt": _GPT2,
    "smollm": _GPT2_DIGITS,
    "starcoder": _GPT2_DIGITS,
    "refact": _GPT2_DIGITS,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "falcon3": _LLAMA3,
    "pixtral": _LLAMA3,
    "smaug-bpe": PreTokenizerRule((_CL100K,)),
    "dbrx": PreTokenizerRule((_CL100K,)),
    "qwen2": PreTokenizerRule((_QWEN2,)),
    "deepseek-r1-qwen": PreTokenizerRule((_QWEN2,)),
    "tekken": PreTokenizerRule((_TEKKEN,), ignore_merges=True, add_bos=True),
    "gpt-4o": PreTokenizerRule((_O200K,)),
    "deepseek-llm": PreTokenizerRule(_DEEPSEEK_LLM, digits=True),
    "deepseek-coder": PreTokenizerRule(_DEEPSEEK_CODER, digits=True),
    "deepseek-v3": PreTokenizerRule(_DEEPSEEK_V3),
}


def pre_tokenizer_rule(pre: str) -> PreTokenizerRule:
    """The rule a tokenizer.ggml.pre value names; unknown names are refused rather than guessed."""
    rule = PRE_TOKENIZERS.get(pre)
    if rule is None:
        raise CheckpointError(
            f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return rule


def build_pre_tokenizer(rule: PreTokenizerRule) -> pre_tokenizers.PreTokenizer:
    """The HF pre-tokenizer of a rule: its Splits, Digits, then the byte-level mapping."""
    steps: list[pre_tokenizers.PreTokenizer] = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in rule.splits]
    if rule.digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=rule.gpt2_regex))
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
