"""Tool-call parsers: find the tool calls in a model's text, whole or as it streams.

Each parser reads the text a model writes when it calls tools, in its family's
format (vLLM's parser names):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, once per
  call (Hermes, Qwen2.5/3, and the format ingot renders for templates without tools);
- ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``), several separated by ``;``, optionally after ``<|python_tag|>``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``, or
  (newer tokenizers) ``[TOOL_CALLS]name[ARGS]{...}`` once per call.

``parse(text, final)`` is a pure function of the text so far: the content (text that
is no tool call) and the calls, each with its name once that is complete and the
arguments' JSON text so far. While streaming (``final=False``) a marker that may be
starting at the end of the text is held back, so content never shows half a tag;
at the end (``final=True``) a call that is not valid JSON makes the whole text
content, as vLLM's parsers do. Scanning jumps between quotes and brackets with
``str.find`` and a compiled pattern, so re-parsing the growing text at every
streamed step stays cheap.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Optional, Protocol

_WS = " \t\r\n"
_SPECIAL = re.compile(r'["{}\[\]]')


@dataclass
class CallText:
    """One tool call as far as the text goes."""

    name: Optional[str]  # None until the name is complete
    arguments: str = ""  # the arguments' JSON text so far (all of it once ``complete``)
    complete: bool = False


@dataclass
class Parsed:
    content: str  # text that is not a tool call (a possible marker at the end held back)
    calls: list[CallText] = field(default_factory=list)


class ToolParser(Protocol):
    name: str
    MARKERS: tuple[str, ...]  # the tags it looks for (special tokens in some vocabularies)

    def parse(self, text: str, final: bool) -> Parsed: ...


# ---------------------------------------------------------------- partial JSON


def skip_ws(s: str, i: int) -> int:
    n = len(s)
    while i < n and s[i] in _WS:
        i += 1
    return i


def _string_end(s: str, i: int) -> Optional[int]:
    """Index after the JSON string opening at ``s[i]``; None if the text ends inside it."""
    j = i + 1
    while True:
        k = s.find('"', j)
        if k < 0:
            return None
        b = k - 1
        while s[b] == "\\":
            b -= 1
        if (k - 1 - b) % 2 == 0:  # an even run of backslashes: the quote is not escaped
            return k + 1
        j = k + 1


def value_end(s: str, i: int) -> Optional[int]:
    """Index after the JSON value starting at ``s[i]``; None if the text ends inside it."""
    n = len(s)
    if i >= n:
        return None
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        depth = 0
        j = i
        while True:
            m = _SPECIAL.search(s, j)
            if m is None:
                return None
            j = m.start()
            ch = s[j]
            if ch == '"':
                end = _string_end(s, j)
                if end is None:
                    return None
                j = end
                continue
            depth += 1 if ch in "{[" else -1
            j += 1
            if depth == 0:
                return j
    j = i
    while j < n and s[j] not in ",}]" + _WS:
        j += 1
    return j if j < n else None  # a number at the very end may still grow


def scan_object(s: str, i: int) -> tuple[dict[str, tuple[int, Optional[int]]], Optional[int], bool]:
    """The members of the object opening at ``s[i]``: key -> (value start, value end or
    None while open); the object's end (None while open); False if it is not JSON."""
    members: dict[str, tuple[int, Optional[int]]] = {}
    n = len(s)
    j = skip_ws(s, i + 1)
    while j < n:
        c = s[j]
        if c == "}":
            return members, j + 1, True
        if c == ",":
            j = skip_ws(s, j + 1)
            continue
        if c != '"':
            return members, None, False
        key_end = _string_end(s, j)
        if key_end is None:
            return members, None, True
        try:
            key = json.loads(s[j:key_end])
        except ValueError:
            return members, None, False
        j = skip_ws(s, key_end)
        if j >= n:
            return members, None, True
        if s[j] != ":":
            return members, None, False
        start = skip_ws(s, j + 1)
        if start >= n:
            return members, None, True
        end = value_end(s, start)
        members[key] = (start, end)
        if end is None:
            return members, None, True
        j = skip_ws(s, end)
    return members, None, True


def call_from_object(s: str, i: int, arg_keys: tuple[str, ...]) -> tuple[Optional[CallText], Optional[int], bool]:
    """The call written as the object at ``s[i]`` (``{"name": ..., <arg key>: {...}}``): the
    call (None before its name), the object's end, and whether it is well formed so far."""
    members, end, ok = scan_object(s, i)
    if not ok:
        return None, end, False
    name = None
    if "name" in members and members["name"][1] is not None:
        start, stop = members["name"]
        try:
            name = json.loads(s[start:stop])
        except ValueError:
            return None, end, False
        if not isinstance(name, str):
            return None, end, False
    if name is None:
        return None, end, True
    key = next((k for k in arg_keys if k in members), None)
    if key is None:
        return CallText(name, "", end is not None), end, True
    start, stop = members[key]
    if s[start] == '"':  # arguments given as a JSON string: its text is the arguments
        if stop is None:
            return CallText(name, ""), end, True
        try:
            return CallText(name, json.loads(s[start:stop]), end is not None), end, True
        except ValueError:
            return None, end, False
    return CallText(name, s[start:stop] if stop is not None else s[start:], end is not None), end, True


def held(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def valid_arguments(call: CallText) -> bool:
    if not call.complete:
        return False
    if not call.arguments.strip():
        call.arguments = "{}"
        return True
    try:
        return isinstance(json.loads(call.arguments), dict)
    except ValueError:
        return False


def _finish(text: str, parsed: Parsed, final: bool) -> Parsed:
    """At the end, a call that is not complete, valid JSON makes the whole text content."""
    if final and parsed.calls and not all(c.name and valid_arguments(c) for c in parsed.calls):
        return Parsed(text, [])
    return parsed


# ---------------------------------------------------------------- parsers


class HermesParser:
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    MARKERS = (START, END)

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(self.START)
        if first < 0:
            return Parsed(text if final else text[: len(text) - held(text, self.START)])
        calls: list[CallText] = []
        pos = first
        while pos >= 0:
            body = skip_ws(text, pos + len(self.START))
            close = text.find(self.END, body)
            region = text[: close] if close >= 0 else text
            if body < len(region):
                if region[body] != "{":
                    return Parsed(text, []) if final else Parsed(text[:first], calls)
                call, _, ok = call_from_object(region, body, ("arguments", "parameters"))
                if not ok:
                    return Parsed(text, []) if final else Parsed(text[:first], calls)
                if call is not None:
                    calls.append(call)
            if close < 0:
                break
            pos = text.find(self.START, close + len(self.END))
        return _finish(text, Parsed(text[:first], calls), final)


class Llama3JsonParser:
    name = "llama3_json"
    TAG = "<|python_tag|>"
    MARKERS = (TAG,)

    def parse(self, text: str, final: bool) -> Parsed:
        s = text.lstrip()
        if s.startswith(self.TAG):
            s = s[len(self.TAG):].lstrip()
        elif not final and self.TAG.startswith(s):  # nothing yet, or the tag is coming
            return Parsed("")
        if not s.startswith("{"):
            return Parsed(text)
        calls: list[CallText] = []
        i = 0
        while True:
            call, end, ok = call_from_object(s, i, ("parameters", "arguments"))
            if not ok:
                return Parsed(text) if final else Parsed("", calls)
            if call is None:
                return Parsed(text) if final and end is not None else Parsed("", calls)
            calls.append(call)
            if end is None:
                break
            j = skip_ws(s, end)
            if j < len(s) and s[j] == ";":
                i = skip_ws(s, j + 1)
                if i < len(s) and s[i] == "{":
                    continue
            break
        return _finish(text, Parsed("", calls), final)


class MistralParser:
    name = "mistral"
    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
    MARKERS = (MARK, ARGS, "[CALL_ID]")

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(self.MARK)
        if first < 0:
            return Parsed(text if final else text[: len(text) - held(text, self.MARK)])
        content = text[:first]
        rest = text[first + len(self.MARK):]
        s = rest.lstrip()
        if s.startswith("["):
            calls = json_call_array(s, ("arguments", "parameters"))
            parsed = None if calls is None else Parsed("", calls)
        elif not s:
            parsed = Parsed(content)
        else:
            parsed = self._named(rest, final)
        if parsed is None:
            return Parsed(text) if final else Parsed(content)
        return _finish(text, Parsed(content, parsed.calls), final)

    def _named(self, rest: str, final: bool) -> Optional[Parsed]:
        calls: list[CallText] = []
        for part in rest.split(self.MARK):
            part = part.lstrip()
            args_at = part.find(self.ARGS)
            brace = part.find("{")
            if args_at >= 0 and (brace < 0 or args_at < brace):
                name, body = part[:args_at].strip(), part[args_at + len(self.ARGS):]
            elif brace >= 0:
                name, body = part[:brace].strip(), part[brace:]
            else:
                if final:
                    return None
                break  # the name is not complete yet
            name = name.split("[CALL_ID]", 1)[0].strip()
            if not name:
                return None
            body = body.lstrip()
            end = value_end(body, 0) if body else None
            calls.append(CallText(name, body[:end] if end is not None else body, end is not None))
        return Parsed("", calls)


def json_call_array(s: str, arg_keys: tuple[str, ...]) -> Optional[list[CallText]]:
    """The calls of a JSON list of call objects (``[{"name": ..., <arg key>: {...}}, ...]``)
    as far as the text goes; None if it is not such a list."""
    calls: list[CallText] = []
    i = skip_ws(s, 0)
    if i >= len(s):
        return calls
    if s[i] != "[":
        return None
    i = skip_ws(s, i + 1)
    while i < len(s):
        if s[i] == "]":
            break
        if s[i] == ",":
            i = skip_ws(s, i + 1)
            continue
        if s[i] != "{":
            return None
        call, end, ok = call_from_object(s, i, arg_keys)
        if not ok:
            return None
        if call is None or end is None:
            if call is not None:
                calls.append(call)
            break
        calls.append(call)
        i = skip_ws(s, end)
    return calls


class RequiredParser:
    """What ``tool_choice: "required"`` makes the model write (its schema enforces it):
    a JSON list of ``{"name", "parameters"}``."""

    name = "required"
    MARKERS = ()

    def parse(self, text: str, final: bool) -> Parsed:
        calls = json_call_array(text, ("parameters",))
        if calls is None:
            return Parsed(text if final else "")
        return Parsed("", calls)  # the schema made it valid; a cut-off list keeps what it has


class NamedParser:
    """What a named ``tool_choice`` makes the model write: the function's arguments alone."""

    name = "named"
    MARKERS = ()

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_ws(text, 0)
        body = text[start:]
        end = value_end(body, 0) if body else None
        call = CallText(self.function, body[:end] if end is not None else body.rstrip() if final else body,
                        end is not None or final)
        return Parsed("", [call])  # the schema made it valid (a cut-off text stays the arguments, as vLLM)


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; ingot has {', '.join(sorted(PARSERS))}") from None
