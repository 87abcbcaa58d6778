"""GGUF pre-tokenizers (tokenizer.ggml.pre) against the models' own tokenizer.json rules.

Each family's pre_tokenizer is transcribed here as its tokenizer.json writes it
(Split regexes, Digits, ByteLevel). Two references check ingot against it:
Python's `regex` module applying those regexes in turn (an independent regex
engine and splitting loop), and an HF `tokenizers` Tokenizer loaded from a
hand-written tokenizer.json with a vocabulary trained under that rule, whose
token ids a GGUF with the same vocabulary and pre name must reproduce.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import pytest
import regex
from tokenizers import Tokenizer, pre_tokenizers, trainers

from ingot.loading.errors import CheckpointError
from ingot.loading.gguf import load_gguf
from ingot.loading.gguf_pre_tokenizers import PRE_TOKENIZERS, build_pre_tokenizer, pre_tokenizer_rule
from ingot.loading.gguf_tokenizer import default_add_bos
from tests.loading.gguf_fixtures import byte_alphabet, write_gguf

# ---------------------------------------------------------------- the rules, as tokenizer.json spells them

GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
CL100K = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
UPPER, LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{UPPER}*{LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{UPPER}+{LOWER}*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
O200K = (rf"[^\r\n\p{{L}}\p{{N}}]?{UPPER}*{LOWER}+{CONTRACTION}|[^\r\n\p{{L}}\p{{N}}]?{UPPER}+{LOWER}*{CONTRACTION}"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# DeepSeek LLM's letters as code point ranges (tokenizer.json spells them as characters).
DEEPSEEK_LETTER_RANGES = """
41-5a 61-7a b5 c0-d6 d8-f6 f8-1ba 1bc-1bf 1c4-293 295-2af 370-373 376 377 37b-37d 37f 386 388-38a 38c
38e-3a1 3a3-3f5 3f7-481 48a-52f 531-556 10a0-10c5 13a0-13f5 13f8-13fd 1c90-1cba 1cbd-1cbf 1d00-1d2b
1d6b-1d77 1d79-1d9a 1e00-1f15 1f18-1f1d 1f20-1f45 1f48-1f4d 1f50-1f57 1f59 1f5b 1f5d 1f5f-1f7d 1f80-1fb4
1fb6-1fbc 1fbe 1fc2-1fc4 1fc6-1fcc 1fd0-1fd3 1fd6-1fdb 1fe0-1fec 1ff2-1ff4 1ff6-1ffc 2102 2107 210a-2113
2115 2119-211d 2124 2126 2128 212a-212d 212f-2134 2139 213c-213f 2145-2149 214e 2183 2184 2c00-2c7b
2c7e-2ce4 2ceb-2cee 2cf2 2cf3 a640-a66d a680-a69b a722-a76f a771-a787 a78b-a78e ab70-abbf fb00-fb06
fb13-fb17 ff21-ff3a ff41-ff5a 10400-1044f 104b0-104d3 104d8-104fb 10c80-10cb2 10cc0-10cf2 118a0-118df
1e900-1e943
"""


def char_class(ranges: str) -> str:
    return "".join("-".join(chr(int(x, 16)) for x in r.split("-")) for r in ranges.split())


DEEPSEEK_CJK = "[" + char_class("4e00-9fa5 800-4e00 ac00-d7ff") + "]+"
DEEPSEEK_PUNCT = r"\s?[" + char_class("21-2f 3a-7e ff01-ff0f ff1a-ff5e 2018-201f 3000-3002") + "]+"


def split(pattern: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


def sequence(*steps: dict[str, Any], use_regex: bool = False) -> dict[str, Any]:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}
    return {"type": "Sequence", "pretokenizers": [*steps, byte_level]}


DIGITS = {"type": "Digits", "individual_digits": True}
GPT2_JSON = sequence(use_regex=True)
SMOLLM_JSON = sequence(DIGITS, use_regex=True)
DEEPSEEK_LLM_JSON = sequence(split("[\r\n]"), split(r"\s?[" + char_class(DEEPSEEK_LETTER_RANGES) + "]+"),
                             split(DEEPSEEK_PUNCT), split(r"\s+$"), split(DEEPSEEK_CJK), DIGITS)
DEEPSEEK_CODER_JSON = sequence(split("[\r\n]"), split(r"\s?\p{L}+"), split(r"\s?\p{P}+"), split(DEEPSEEK_CJK), DIGITS)
DEEPSEEK_V3_JSON = sequence(
    split(r"\p{N}{1,3}"),
    split("[" + char_class("4e00-9fa5 3040-309f 30a0-30ff") + "]+"),
    split("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
          "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"),
)

# pre name -> (the family's tokenizer.json pre_tokenizer, BPE ignore_merges, llama.cpp's default add_bos)
RULES: dict[str, tuple[dict[str, Any], bool, bool]] = {
    **{name: (GPT2_JSON, False, False) for name in ("default", "gpt-2", "gpt2", "phi-2", "olmo", "mpt")},
    **{name: (SMOLLM_JSON, False, False) for name in ("smollm", "starcoder", "refact")},
    **{name: (sequence(split(CL100K)), True, True) for name in ("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral")},
    **{name: (sequence(split(CL100K)), False, False) for name in ("smaug-bpe", "dbrx")},
    **{name: (sequence(split(QWEN2)), False, False) for name in ("qwen2", "deepseek-r1-qwen")},
    "tekken": (sequence(split(TEKKEN)), True, True),
    "gpt-4o": (sequence(split(O200K)), False, False),
    "deepseek-llm": (DEEPSEEK_LLM_JSON, False, False),
    "deepseek-coder": (DEEPSEEK_CODER_JSON, False, False),
    "deepseek-v3": (DEEPSEEK_V3_JSON, False, False),
}

TRICKY = [
    "1 12 123 1234 12345 123456 1234567",
    "a1b22c333d4444e55555f",
    "3.14159, 2,000,000 and 0.5%; v1.2.3-rc4",
    "٣٤٥ ½ ² ⅷ",
    "我想在apple工作1314151天～",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 텍스트 입니다",
    "I'm sure they've done it; we'll see what's what. 'D you? I'M OK, DON'T, We'Ve a'lL",
    "Привет мир, Γειά σου κόσμε",
    " שלום עולם مرحبا بالعالم",
    "नमस्ते दुनिया กรุงเทพ",
    "Ωhm Kelvin ᾼ ῼ ᾳ µ",
    "🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙",
    "a  b   c    d     e",
    "\t\ttabs\t and \u3000ideographic\u3000 and nbsp\u00a0here",
    "trailing spaces   ",
    "emoji then spaces 🦙🦙   \nשלום  ",
    "   leading spaces",
    "line1\nline2\r\nline3\n\n\nend\n",
    " \n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n",
    "Hello, world!!! ...??? ------======= ''''''```````\"\"\"\"......!!!!!!??????",
    "#include <stdio.h>\nint main(void) { return x->y + a[i]; }",
    "path/to/file.py and https://example.com/a?b=c&d=e",
    "snake_case and camelCase and PascalCase and HTMLParser and iPhone",
    "x+=1; y**=2; z<<=3 $100 @user ~tilde ^caret |pipe `tick`",
    "（全角括号）「引用」…—‘single’ “double”",
    "are you sure？! ok：1 ＃tag ｆｕｌｌ　width",
    "ünïcödé façade — naïve café",
    "",
]


def isolate(pattern: str, pieces: list[str]) -> list[str]:
    """Split each piece at the pattern's matches, keeping the matches and the text between them."""
    out = []
    for piece in pieces:
        pos = 0
        for m in regex.finditer(pattern, piece):
            if m.start() > pos:
                out.append(piece[pos:m.start()])
            out.append(m.group())
            pos = m.end()
        if pos < len(piece):
            out.append(piece[pos:])
    return out


BYTES = byte_alphabet()


def byte_level(piece: str) -> str:
    return "".join(BYTES[b] for b in piece.encode("utf-8"))


def regex_module_split(rule: dict[str, Any], text: str) -> list[str]:
    """The pieces the tokenizer.json pre_tokenizer makes of text, by the `regex` module."""
    pieces = [text] if text else []
    for step in rule["pretokenizers"]:
        if step["type"] == "Split":
            pieces = isolate(step["pattern"]["Regex"], pieces)
        elif step["type"] == "Digits":
            pieces = isolate(r"\p{N}", pieces)
        elif step["type"] == "ByteLevel" and step["use_regex"]:
            pieces = isolate(GPT2_REGEX, pieces)
    return [byte_level(p) for p in pieces]


# ---------------------------------------------------------------- the splits


def test_every_supported_name_has_a_transcribed_rule() -> None:
    assert set(PRE_TOKENIZERS) == set(RULES)


@pytest.mark.parametrize("pre", sorted(RULES))
def test_splits_match_the_regex_module(pre: str) -> None:
    rule, ignore_merges, add_bos = RULES[pre]
    ours = build_pre_tokenizer(pre_tokenizer_rule(pre))
    for text in TRICKY:
        assert [p for p, _ in ours.pre_tokenize_str(text)] == regex_module_split(rule, text), (pre, text)
    assert pre_tokenizer_rule(pre).ignore_merges == ignore_merges
    assert default_add_bos({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre}) == add_bos


@pytest.mark.parametrize(
    "pre, text, pieces",
    [
        ("deepseek-v3", "x 1234567", ["x", " ", "123", "456", "7"]),
        ("deepseek-v3", "你好world\n#include don't", ["你好", "world", "\n", "#include", " don", "'t"]),
        ("deepseek-llm", "abc 12", ["abc", " ", "1", "2"]),
        ("deepseek-llm", "Привет שלום", ["Привет", " שלום"]),
        ("deepseek-llm", "a\n\nb", ["a", "\n", "\n", "b"]),
        ("deepseek-coder", "Привет שלום", ["Привет", " שלום"]),
        ("deepseek-coder", "x+=12", ["x", "+=", "1", "2"]),
        ("gpt-4o", "HelloWorld I'M 12345", ["Hello", "World", " I'M", " ", "123", "45"]),
        ("dbrx", "HelloWorld 12345", ["HelloWorld", " ", "123", "45"]),
    ],
)
def test_splits_by_hand(pre: str, text: str, pieces: list[str]) -> None:
    ours = build_pre_tokenizer(pre_tokenizer_rule(pre))
    assert [p for p, _ in ours.pre_tokenize_str(text)] == [byte_level(p) for p in pieces]


def test_deepseek_letters_are_not_normalized() -> None:
    """Ohm and Kelvin signs are letters of the class; the Greek omega and K they normalize to are separate code points."""
    ours = build_pre_tokenizer(pre_tokenizer_rule("deepseek-llm"))
    assert [p for p, _ in ours.pre_tokenize_str("\u2126\u212a\u1fbe")] == [byte_level("\u2126\u212a\u1fbe")]
    assert [p for p, _ in ours.pre_tokenize_str("x\u03a9")] == ["x", byte_level("\u03a9")]


def test_unknown_pre_tokenizer_is_refused() -> None:
    with pytest.raises(CheckpointError, match="unsupported GGUF pre-tokenizer 'no-such-pre'.*deepseek-v3"):
        pre_tokenizer_rule("no-such-pre")


# ---------------------------------------------------------------- end to end through a GGUF

CORPUS = [*TRICKY, "The quick brown fox jumps over the lazy dog. " * 4, "def f(x):\n    return x * 2\n" * 3,
          "2024-01-31 12:34:56 and 999 999 1000000", "DeepSeekV3 and gpt-oss and HTTPServer"]
END_TO_END = ["deepseek-llm", "deepseek-coder", "deepseek-v3", "gpt-4o", "dbrx", "llama-bpe", "qwen2", "tekken", "smollm",
              "gpt-2"]
NO_SPLIT = sequence()  # ByteLevel alone: merges learnt across every boundary any rule draws
Vocabulary = tuple[dict[str, int], list[list[str]]]


def tokenizer_json(pre_tokenizer: dict[str, Any], ignore_merges: bool, vocab: dict[str, int], merges: list[list[str]]) -> str:
    """A tokenizer.json as the models publish it: byte-level BPE, its pre_tokenizer, <|endoftext|> special."""
    eot = "<|endoftext|>"
    return json.dumps({
        "version": "1.0",
        "added_tokens": [{"id": vocab[eot], "content": eot, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}] if eot in vocab else [],
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
                  "vocab": vocab, "merges": merges},
    })


def train(pre_tokenizer: dict[str, Any], vocab_size: int) -> Vocabulary:
    tok = Tokenizer.from_str(tokenizer_json(pre_tokenizer, False, {}, []))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    return model["vocab"], [m if isinstance(m, list) else m.split(" ", 1) for m in model["merges"]]


@pytest.fixture(scope="module")
def vocabularies() -> dict[str, Vocabulary]:
    """A byte-level BPE trained under each rule (as the models' are), and one trained without any split."""
    return {"no split": train(NO_SPLIT, 1200), **{pre: train(RULES[pre][0], 900) for pre in END_TO_END}}


def reference_tokenizer(pre: str, vocabulary: Vocabulary) -> Tokenizer:
    rule, ignore_merges, _ = RULES[pre]
    return Tokenizer.from_str(tokenizer_json(rule, ignore_merges, *vocabulary))


def gguf_tokenizer(tmp_path: Path, vocabulary: Vocabulary, pre: str) -> Tokenizer:
    """The vocabulary and merges written to a GGUF as llama.cpp does, under the pre name, loaded by ingot."""
    vocab, merges = vocabulary
    tokens = sorted(vocab, key=vocab.get)

    def meta(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
        w.add_token_merges([" ".join(m) for m in merges])

    return load_gguf(write_gguf(tmp_path / f"{pre}.gguf", tokenizer=False, meta=meta)).tokenizer


TEXTS = [*TRICKY, "<|endoftext|>after the end\n"]


@pytest.mark.parametrize("pre", END_TO_END)
@pytest.mark.parametrize("trained_under", ["its rule", "no split"])
def test_gguf_tokenizer_matches_the_models_tokenizer_json(
    tmp_path: Path, vocabularies: dict[str, Vocabulary], pre: str, trained_under: str
) -> None:
    vocabulary = vocabularies[pre if trained_under == "its rule" else trained_under]
    reference, ours = reference_tokenizer(pre, vocabulary), gguf_tokenizer(tmp_path, vocabulary, pre)
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == reference.encode(text).ids, (pre, text)
        assert ours.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("pre", END_TO_END)
def test_another_familys_rule_gives_other_ids(tmp_path: Path, vocabularies: dict[str, Vocabulary], pre: str) -> None:
    """The comparison above tells the rules apart: under any other family's name the same file tokenizes differently."""
    vocabulary = vocabularies["no split"]
    expected = [reference_tokenizer(pre, vocabulary).encode(t).ids for t in TEXTS]
    for other in END_TO_END:
        if RULES[other][0] != RULES[pre][0]:
            wrong = gguf_tokenizer(tmp_path, vocabulary, other)
            assert [wrong.encode(t).ids for t in TEXTS] != expected, (pre, other)
