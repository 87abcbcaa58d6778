"""Request fields ingot does not implement: refused by name, or ignored with one warning.

A field that OpenAI's or vLLM's API defines and ingot does not implement gets a 400
naming it when it is set to anything that would change the answer (``store: true``,
``use_beam_search: true``, ``suffix: "..."``); its default or an equivalent value
passes. A field neither API defines is ignored, with one logged warning per field
name for the server's life (vLLM logs the fields it ignores, too).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional

log = logging.getLogger("ingot.serve")


def _off(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


def _one_of(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in allowed


def _anything(value: Any) -> bool:
    return True


# Fields of both APIs that only identify the caller or hint a cache: accepted, unused.
_IDENTIFIERS = {name: _anything for name in ("user", "safety_identifier", "prompt_cache_key", "session_id")}

# field -> is this value one ingot can honour (a default, or what ingot does anyway)?
_SHARED: dict[str, Callable[[Any], bool]] = {
    **_IDENTIFIERS,
    "use_beam_search": _off,
    "length_penalty": _one_of(1, 1.0),
    "watermarking": _off,
    "spaces_between_special_tokens": _one_of(True),
    "logprob_token_ids": _off,
    "logits_processors": _off,
    "return_tokens_as_token_ids": _off,
    "return_token_ids": _off,
    "return_token_offsets": _off,
    "return_prompt_text": _off,
    "return_mm_kwargs": _anything,  # vLLM reads it on its render endpoints only
    "kv_transfer_params": _off,
    "ec_transfer_params": _off,
    "vllm_xargs": _off,
    "repetition_detection": _off,
    "stream_interval": _one_of(1),
    "priority": _one_of(0),
    "routed_experts_prompt_start": _one_of(0),
    "thinking_token_budget": _off,
    "mm_processor_kwargs": _off,
    "media_io_kwargs": _off,
    "guided_whitespace_pattern": _off,
    "prompt_embeds": _off,
    "store": _off,
    "metadata": _off,
    "service_tier": _one_of("auto", "default"),
    "prompt_cache_retention": _off,
    "prompt_cache_options": _off,
}
COMPLETION_REFUSED: dict[str, Callable[[Any], bool]] = {**_SHARED, "suffix": _off}
CHAT_REFUSED: dict[str, Callable[[Any], bool]] = {
    **_SHARED,
    "functions": _off,
    "function_call": _off,
    "audio": _off,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": _off,
    "web_search_options": _off,
    "verbosity": _one_of("medium"),
    "moderation": _off,
    "echo": _off,
}

_HINTS = {
    "functions": "use tools",
    "function_call": "use tool_choice",
    "use_beam_search": "ingot has no beam search",
    "suffix": "ingot has no fill-in-the-middle",
}

_warned: set[str] = set()


def refused(extra: Optional[dict[str, Any]], table: dict[str, Callable[[Any], bool]]) -> Optional[tuple[str, str]]:
    """(field, message) for the first field set to a value ingot cannot honour; unknown
    fields are logged once by name."""
    if not extra:
        return None
    unknown = []
    for name, value in extra.items():
        ok = table.get(name)
        if ok is None:
            unknown.append(name)
        elif not ok(value):
            hint = _HINTS.get(name)
            return name, f"{name} is not supported by ingot" + (f" ({hint})" if hint else "")
    warn_unknown(unknown)
    return None


def warn_unknown(names: Iterable[str]) -> None:
    for name in names:
        if name not in _warned:
            _warned.add(name)
            log.warning("ignoring the request field %r: neither OpenAI's nor vLLM's API defines it "
                        "(logged once per field name)", name)
