"""Reasoning parsers: a thinking model's ``<think>...</think>`` split from its answer.

``ingot serve --reasoning-parser qwen3|deepseek_r1`` returns the text between the
tags as ``reasoning_content`` (streamed as its own deltas) and what follows as the
answer (``content``, where tool calls are then looked for). The two differ only in
where a reply starts when nothing says otherwise:

- ``deepseek_r1``: in the reasoning (DeepSeek-R1's template opens ``<think>`` in the
  prompt, so its replies often carry only the closing tag); without ``</think>`` the
  whole reply is reasoning.
- ``qwen3``: in the answer; reasoning starts only if the reply opens with ``<think>``
  (Qwen3 writes it itself), or the prompt ends with an open ``<think>`` (templates of
  thinking-only models put it there).

Either way a prompt that already ends with ``</think>`` (Qwen3's template with
``enable_thinking: false``) leaves the whole reply to the answer. The engine decides
where a structured-output constraint starts by the same rule (``engine/reasoning.py``),
so the answer split off here is the part the constraint applied to. ``split`` is a pure
function of the text so far; while streaming, a tag that may be starting at the end
is held back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ingot.config import REASONING_PARSERS
from ingot.engine.reasoning import END, START
from ingot.serve.tool_parsers import held


@dataclass
class Split:
    reasoning: Optional[str]  # None: the reply has no reasoning (so far)
    content: str


class ReasoningParser:
    def __init__(self, kind: str, prompt: str = "") -> None:
        if kind not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {kind!r}; ingot has {', '.join(REASONING_PARSERS)}")
        self.kind = kind
        tail = prompt.rstrip()
        self.prompt_ended = tail.endswith(END)
        self.opens_in_reasoning = not self.prompt_ended and (kind == "deepseek_r1" or tail.endswith(START))

    def split(self, text: str, final: bool) -> Split:
        if self.prompt_ended:
            return Split(None, text)
        stripped = text.lstrip()
        if stripped.startswith(START):
            begin = len(text) - len(stripped) + len(START)
        elif not final and START.startswith(stripped):  # nothing yet, or the tag is coming
            return Split(None, "")
        elif self.opens_in_reasoning:
            begin = 0
        else:
            return Split(None, text)
        end = text.find(END, begin)
        if end < 0:
            reasoning = text[begin:] if final else text[begin: len(text) - held(text, END)]
            return Split(reasoning, "")
        return Split(text[begin:end], text[end + len(END):])
