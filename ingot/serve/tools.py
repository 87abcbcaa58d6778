"""Tool calling in chat completions, as vLLM's server does it.

``tools`` go to the chat template (``tools=`` in its context; a template without a
tool section gets them in the system prompt, ``loading/tokenizer.py``). What the
model may do with them follows ``tool_choice``:

- ``none``: nothing; the reply is text.
- ``auto`` (the default when ``tools`` are given): the model decides; the server's
  ``--tool-call-parser`` finds calls in the reply. Needs ``--enable-auto-tool-choice``.
- ``required``: a structured-output constraint makes the reply a JSON list of
  ``{"name", "parameters"}`` (each one of the tools, its parameters its schema; at
  least one; one at most with ``parallel_tool_calls: false``).
- a named function: the constraint is that function's parameters schema, and the
  reply is its arguments.

So ``required`` and named calls are always valid JSON of the tools' schemas (the
constraints leave no free whitespace, so a small model cannot pad them forever).
``ChoiceStream`` turns one choice's text into OpenAI's message, or, streaming, into
its deltas: ``reasoning_content`` (with a reasoning parser), ``content``, and
``tool_calls`` (the first delta of a call with its id, type and name, then pieces of
its arguments).
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from ingot.serve.errors import APIError
from ingot.serve.reasoning import ReasoningParser
from ingot.serve.tool_parsers import NamedParser, Parsed, RequiredParser, ToolParser, get_parser


@dataclass
class ToolSettings:
    """The server's tool and reasoning options (``ingot serve`` flags)."""

    tool_call_parser: Optional[str] = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: Optional[str] = None


@dataclass
class ToolPlan:
    """What one request does with its tools."""

    choice: str  # none | auto | required | named
    function: Optional[str] = None  # the named function
    schema: Optional[dict[str, Any]] = None  # the constraint of required / named
    parallel: bool = True

    def parser(self, settings: ToolSettings) -> Optional[ToolParser]:
        if self.choice == "auto":
            return get_parser(settings.tool_call_parser or "")
        if self.choice == "required":
            return RequiredParser()
        if self.choice == "named":
            return NamedParser(self.function or "")
        return None


def plan(tools: Optional[list[Any]], tool_choice: Any, parallel: Optional[bool], settings: ToolSettings) -> Optional[ToolPlan]:
    """The request's ToolPlan (None without tools); a 400 for a choice the server cannot honour."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    functions = {t.function.name: t.function for t in tools}
    choice = tool_choice if tool_choice is not None else "auto"
    allow_many = parallel is not False
    if choice == "none":
        return ToolPlan("none")
    if choice == "auto":
        if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
            raise APIError(400, '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                                "--tool-call-parser NAME (or send tool_choice \"none\", \"required\" or a named function)",
                           "tool_choice")
        return ToolPlan("auto", parallel=allow_many)
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                   "parameters": _parameters(f)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, f in functions.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not allow_many:
            schema["maxItems"] = 1
        return ToolPlan("required", schema=schema, parallel=allow_many)
    name = choice.function.name
    if name not in functions:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools "
                            f"({', '.join(functions)})", "tool_choice")
    return ToolPlan("named", function=name, schema=_parameters(functions[name]))


def _parameters(function: Any) -> dict[str, Any]:
    """A function's parameters schema (no parameters: an empty object)."""
    return function.parameters if function.parameters is not None else {"type": "object", "properties": {}}


def call_id(parser: Optional[str]) -> str:
    """A new tool-call id: ``chatcmpl-tool-<hex>``; Mistral's templates insist on 9 letters or digits."""
    if parser == "mistral":
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def canonical_arguments(text: str) -> str:
    """A call's arguments as compact JSON text (as given if they are not JSON)."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text


@dataclass
class _Sent:
    id: str
    arguments: int = 0  # characters of the arguments sent


@dataclass
class ChoiceStream:
    """One choice's text through the reasoning parser and the tool parser, whole or as deltas."""

    reasoning: Optional[ReasoningParser] = None
    tools: Optional[ToolParser] = None
    include_reasoning: bool = True
    parallel: bool = True
    id_style: Optional[str] = None
    _reasoning_sent: int = 0
    _content_sent: int = 0
    _calls: list[_Sent] = field(default_factory=list)

    def _split(self, text: str, final: bool) -> tuple[Optional[str], str]:
        if self.reasoning is None:
            return None, text
        split = self.reasoning.split(text, final)
        return split.reasoning, split.content

    def _parse(self, content: str, final: bool) -> Parsed:
        if self.tools is None:
            return Parsed(content)
        parsed = self.tools.parse(content, final)
        if not self.parallel:
            parsed.calls = parsed.calls[:1]
        return parsed

    def message(self, text: str) -> dict[str, Any]:
        """The whole reply as OpenAI's assistant message."""
        reasoning, content = self._split(text, True)
        parsed = self._parse(content, True)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": parsed.content if parsed.content or reasoning is None else None}
        if reasoning is not None and self.include_reasoning:
            message["reasoning_content"] = reasoning
        if parsed.calls:
            message["content"] = parsed.content.strip() or None
            message["tool_calls"] = [{"id": call_id(self.id_style), "type": "function",
                                      "function": {"name": c.name, "arguments": canonical_arguments(c.arguments)}}
                                     for c in parsed.calls]
        return message

    @property
    def called(self) -> bool:
        """Has the stream sent a tool call?"""
        return bool(self._calls)

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """What ``text`` (the reply so far) adds to what was sent: OpenAI's delta fields."""
        out: dict[str, Any] = {}
        reasoning, content = self._split(text, final)
        if reasoning is not None and len(reasoning) > self._reasoning_sent:
            if self.include_reasoning:
                out["reasoning_content"] = reasoning[self._reasoning_sent:]
            self._reasoning_sent = len(reasoning)
        parsed = self._parse(content, final)
        if len(parsed.content) > self._content_sent and not self._calls:
            out["content"] = parsed.content[self._content_sent:]
            self._content_sent = len(parsed.content)
        calls = []
        for i, c in enumerate(parsed.calls):
            if c.name is None:
                break
            if i == len(self._calls):
                self._calls.append(_Sent(call_id(self.id_style)))
                sent = self._calls[i]
                calls.append({"index": i, "id": sent.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}})
                sent.arguments = len(c.arguments)
                continue
            sent = self._calls[i]
            if len(c.arguments) > sent.arguments:
                calls.append({"index": i, "function": {"arguments": c.arguments[sent.arguments:]}})
                sent.arguments = len(c.arguments)
        if calls:
            out["tool_calls"] = calls
        return out
