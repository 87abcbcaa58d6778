"""A thinking model's reasoning under structured outputs: where a reply's constraint starts.

With ``EngineConfig.reasoning_parser`` (vLLM's ``reasoning_parser``) a constraint applies to
the answer after ``</think>``; the reasoning before it is free. Each constrained sequence
starts in one of three phases, decided from the end of its prompt (the same rule
``ingot serve`` splits the reply's text by, ``serve/reasoning.py``):

- ``ACTIVE``: the prompt ends with ``</think>`` (whitespace aside; Qwen3's template with
  ``enable_thinking: false``): the grammar constrains the first token;
- ``REASONING``: the prompt ends with ``<think>`` (templates of thinking models), or always
  with ``deepseek_r1`` otherwise: every token is allowed until ``</think>`` is sampled;
- ``OPENING`` (``qwen3`` otherwise): the first token is the grammar's or ``<think>``, which
  starts the reasoning; any other token is the answer's first.

The two tags must each be one token of the vocabulary (they are added tokens in Qwen3's
and DeepSeek-R1's tokenizers): the engine refuses to start otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ingot.config import ConfigError
from ingot.loading.tokenizer import Tokenizer

START, END = "<think>", "</think>"
ACTIVE, REASONING, OPENING = "active", "reasoning", "opening"


@dataclass(frozen=True)
class ReasoningTags:
    """A reasoning parser's tags as token ids, and how it decides a sequence's first phase."""

    parser: str
    start: int  # <think>
    end: int  # </think>
    tokenizer: Tokenizer

    def first_phase(self, prompt_ids: Sequence[int]) -> str:
        """The phase a reply to ``prompt_ids`` starts in: which tag ends the prompt (tokens of
        whitespace after it aside), else the parser's default."""
        for i in range(len(prompt_ids) - 1, -1, -1):
            token = prompt_ids[i]
            if token == self.end:
                return ACTIVE
            if token == self.start:
                return REASONING
            if self.tokenizer.decode([token]).strip():
                break
        return REASONING if self.parser == "deepseek_r1" else OPENING


def reasoning_tags(parser: str, tokenizer: Tokenizer) -> ReasoningTags:
    """``parser``'s tags (a name ``EngineConfig`` has checked) in ``tokenizer``'s vocabulary;
    ConfigError unless each is one token."""
    ids = []
    for tag in (START, END):
        token = tokenizer.tok.token_to_id(tag)
        if token is None or tokenizer.encode(tag, add_special_tokens=False) != [token]:
            raise ConfigError(f"reasoning_parser {parser!r}: the tokenizer has no single token {tag!r} (the parser "
                              f"needs {START} and {END} as tokens of their own, as Qwen3 and DeepSeek-R1 have)",
                              "reasoning_parser")
        ids.append(token)
    return ReasoningTags(parser, ids[0], ids[1], tokenizer)
