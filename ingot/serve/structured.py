"""Structured outputs over HTTP: every way a request asks for a grammar, as one
``StructuredOutputsParams`` (the engine compiles it with xgrammar).

The ways, of which a request may use one:

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint),
  ``{"type": "json_object"}`` (any JSON object), ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`` (the schema is enforced whatever
  ``strict`` says, as vLLM does), and vLLM's ``{"type": "structural_tag", ...}``;
- vLLM's ``structured_outputs`` (an object with ``StructuredOutputsParams``' fields);
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar`` and ``structural_tag``, with ``guided_decoding_backend``
  ``xgrammar`` or ``auto`` (``xgrammar:disable-any-whitespace`` too).

``tool_choice: "required"`` or a named function adds its own constraint (``tools.py``);
it cannot be combined with these.
"""

from __future__ import annotations

from typing import Any, Optional

from ingot.sampling_params import SamplingError, StructuredOutputsParams
from ingot.serve.errors import APIError

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
           "structural_tag": "structural_tag"}
_BACKENDS = ("xgrammar", "auto")


def make_params(fields: dict[str, Any], param: str) -> StructuredOutputsParams:
    """``StructuredOutputsParams(**fields)``; a 400 naming ``param`` if it is malformed."""
    try:
        return StructuredOutputsParams(**fields)
    except TypeError as exc:
        raise APIError(400, f"{param}: {exc}", param) from None
    except SamplingError as exc:
        raise APIError(400, f"{param}: {exc}", param) from None


def _from_response_format(rf: dict[str, Any]) -> Optional[dict[str, Any]]:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError(400, "response_format.json_schema must be an object with 'name' and 'schema'",
                           "response_format")
        schema = spec.get("schema", spec.get("json_schema"))
        return {"json": schema if schema is not None else {"type": "object"}}
    if kind == "structural_tag":
        return {"structural_tag": rf}
    raise APIError(400, f"response_format type {kind!r} is not supported (text, json_object, json_schema, "
                        "structural_tag)", "response_format")


def requested(body: Any) -> tuple[Optional[str], Optional[StructuredOutputsParams]]:
    """(the field that asked, StructuredOutputsParams) for the request's constraint, or (None, None)."""
    asks: list[tuple[str, dict[str, Any]]] = []
    rf = getattr(body, "response_format", None)
    if rf is not None:
        fields = _from_response_format(rf)
        if fields is not None:
            asks.append(("response_format", fields))
    if body.structured_outputs is not None:
        if not isinstance(body.structured_outputs, dict):
            raise APIError(400, "structured_outputs must be an object", "structured_outputs")
        asks.append(("structured_outputs", dict(body.structured_outputs)))
    for name, key in _GUIDED.items():
        value = getattr(body, name, None)
        if value is not None:
            asks.append((name, {key: value}))
    backend = body.guided_decoding_backend
    whitespace = False
    if backend is not None:
        base, _, option = str(backend).partition(":")
        if base not in _BACKENDS or option not in ("", "disable-any-whitespace"):
            raise APIError(400, f"guided_decoding_backend {backend!r} is not supported: ingot's structured outputs "
                                "run on xgrammar ('xgrammar' or 'auto')", "guided_decoding_backend")
        whitespace = option == "disable-any-whitespace"
    if not asks:
        return None, None
    if len(asks) > 1:
        names = ", ".join(a[0] for a in asks)
        raise APIError(400, f"give one structured-output constraint, not several ({names})", asks[1][0])
    param, fields = asks[0]
    if whitespace:
        fields.setdefault("disable_any_whitespace", True)
    return param, make_params(fields, param)
