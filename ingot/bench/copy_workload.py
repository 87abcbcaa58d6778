"""The copy workload of ``ingot bench serve --workload copy``: prompts whose answers repeat
text from the prompt, as code editing and summarising do (where n-gram speculation pays).

The text is the standard library's own source, so every Python installation has it and no
data set is downloaded: the functions and methods of ``SOURCE_MODULES`` (code), and the
paragraphs of their docstrings (prose). A prompt asks to rewrite code without changing it
(``INSTRUCTIONS["code"]``; the standard library already names its variables in snake_case,
so the faithful answer is the code itself) or to repeat a text (``INSTRUCTIONS["text"]``),
rendered through the model's chat template when it has one (else instruction and text as
plain text). Each prompt is exactly its asked number of tokens: the template's and the
instruction's tokens around the first ones of consecutive passages, cut at a token. The
same seed gives the same prompts on the same Python version (its sources are the text).
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import random
import textwrap
from dataclasses import dataclass
from typing import Any, Sequence

# Pure-Python standard-library modules whose source is the text (in this order).
SOURCE_MODULES = (
    "argparse", "textwrap", "difflib", "heapq", "bisect", "fractions", "statistics", "string", "shlex", "csv",
    "calendar", "configparser", "dataclasses", "functools", "pprint", "ipaddress", "json.decoder", "json.encoder",
    "tokenize", "gettext", "enum", "contextlib", "tempfile", "shutil", "fnmatch", "glob", "copy", "base64",
)
INSTRUCTIONS = {
    "code": "Rewrite this code with every variable renamed to snake_case, changing nothing else:",
    "text": "Repeat the following text exactly:",
}
MIN_TEXT_TOKENS = 16  # a prompt shorter than its frame + this is refused
_SLOT = "@@INGOT-COPY-TEXT@@"  # where the text goes in the rendered chat template
_MIN_PARAGRAPH_CHARS = 40


@dataclass(frozen=True)
class CopyPrompt:
    """One prompt: its token ids, which instruction it carries, and where the text it asks
    to copy lies in ``token_ids`` (``[text_start, text_end)``)."""

    token_ids: list[int]
    kind: str  # "code" | "text"
    text_start: int
    text_end: int


def _module_passages(name: str) -> tuple[list[str], list[str]]:
    """(code, prose) of one module: each function and method's source (decorators included,
    dedented), and each docstring paragraph, in a fixed order (ast.walk's)."""
    source = inspect.getsource(importlib.import_module(name))
    lines = source.splitlines()
    code: list[str] = []
    prose: list[str] = []
    tree = ast.parse(source)
    for node in ast.walk(tree):  # breadth-first: module, then classes and functions in source order
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                prose += [p for p in doc.split("\n\n") if len(p.strip()) >= _MIN_PARAGRAPH_CHARS]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            code.append(textwrap.dedent("\n".join(lines[first - 1 : node.end_lineno])))
    return code, prose


@functools.lru_cache(maxsize=1)
def passages() -> dict[str, tuple[str, ...]]:
    """Every module's code and prose passages, by instruction kind."""
    code: list[str] = []
    prose: list[str] = []
    for name in SOURCE_MODULES:
        c, p = _module_passages(name)
        code += c
        prose += p
    return {"code": tuple(code), "text": tuple(prose)}


def _frame(tokenizer: Any, kind: str) -> tuple[list[int], list[int]]:
    """The tokens before and after the text: the chat template around the instruction, or
    (no template) the instruction as plain text."""
    instruction = INSTRUCTIONS[kind]
    try:
        rendered = tokenizer.render_chat([{"role": "user", "content": f"{instruction}\n\n{_SLOT}"}])
        head, tail = rendered.split(_SLOT)  # ValueError too if the template altered the slot
    except ValueError:
        return tokenizer.encode(f"{instruction}\n\n"), tokenizer.encode("\n\n", add_special_tokens=False)
    return tokenizer.encode(head, add_special_tokens=False), tokenizer.encode(tail, add_special_tokens=False)


def _text_tokens(tokenizer: Any, pool: Sequence[str], start: int, count: int) -> list[int]:
    """The first ``count`` tokens of ``pool``'s passages from ``start`` on (wrapping), joined
    by blank lines."""
    taken, text, chars = 0, "", count * 4
    while True:
        while len(text) < chars and taken < len(pool):
            text += ("\n\n" if text else "") + pool[(start + taken) % len(pool)]
            taken += 1
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= count:
            return ids[:count]
        if taken >= len(pool):
            raise ValueError(f"the copy workload's text holds {len(ids)} tokens, fewer than the {count} asked")
        chars *= 2


def copy_prompts(tokenizer: Any, lengths: Sequence[int], seed: int) -> list[CopyPrompt]:
    """One prompt of each length in ``lengths`` (tokens, template included); ``seed`` picks
    each prompt's instruction and first passage. ValueError when a length leaves fewer than
    ``MIN_TEXT_TOKENS`` for the text, or when ``tokenizer`` has no vocabulary for text."""
    rng = random.Random(f"copy-{seed}")
    pools = passages()
    frames = {kind: _frame(tokenizer, kind) for kind in INSTRUCTIONS}
    out = []
    for length in lengths:
        kind = rng.choice(sorted(INSTRUCTIONS))
        start = rng.randrange(len(pools[kind]))
        head, tail = frames[kind]
        count = length - len(head) - len(tail)
        if count < MIN_TEXT_TOKENS:
            need = len(head) + len(tail) + MIN_TEXT_TOKENS
            raise ValueError(f"a copy prompt of {length} tokens leaves {max(count, 0)} for its text after the "
                             f"instruction and chat template; copy prompts need at least {need} tokens (--input-len)")
        text = _text_tokens(tokenizer, pools[kind], start, count)
        if len(set(text)) < 8:
            raise ValueError("the tokenizer turns the copy workload's text into fewer than 8 distinct tokens: it has no "
                             "vocabulary for text (a --shape takes one with --tokenizer, e.g. --tokenizer default)")
        out.append(CopyPrompt(head + text + tail, kind, len(head), len(head) + count))
    return out
