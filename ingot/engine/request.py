"""Requests as the engine receives them: validated and tokenized before they reach the loop.

``InputProcessor`` turns what a caller brings (text, token ids, a prompt dict,
a chat conversation, sampling params) into an ``EngineRequest``, or raises
``RequestError`` naming what is wrong. It only reads the tokenizer and the
model's limits, so any thread may call it: callers tokenize in their own
thread while the engine loop keeps stepping. ``check_params`` checks what
sampling params depend on the model for: the token ids of ``logit_bias`` and
``allowed_token_ids`` against the vocabulary, ``bad_words`` tokenized (vLLM's
way: each word without its leading spaces, and with one space before it where
that gives as many tokens, starting with another one) into
``params.bad_words_token_ids``, which travels with the params to the engine;
and structured outputs (xgrammar builds the grammar, without the vocabulary;
the engine compiles it against the vocabulary, off its loop).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from ingot.engine import structured
from ingot.loading.tokenizer import Message, Tokenizer
from ingot.sampling_params import SamplingParams

# What a prompt may be: text, token ids, or vLLM's prompt dicts.
Prompt = Union[str, Sequence[int], Mapping[str, Any]]

_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


class RequestError(ValueError):
    """One request is invalid (empty, too long, bad token ids...). Other requests are unaffected.
    ``param``: the sampling field it concerns, where one does."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class EngineRequest:
    """A request ready for the engine: its prompt as token ids, its params, its identity."""

    request_id: str
    prompt: Optional[str]  # the text, when the prompt was text
    prompt_token_ids: list[int]
    params: SamplingParams
    # True: the caller reads outputs as they come (per-step text); False: only the final one
    stream: bool = True
    cache_salt: Optional[str] = None  # keeps this request's cached prefix apart from other tenants'
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_wall: float = field(default_factory=time.time)


class InputProcessor:
    """Validation and tokenization of requests against one model's tokenizer and limits."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def process(
        self,
        prompt: Prompt,
        params: Optional[SamplingParams],
        request_id: str,
        *,
        stream: bool = True,
        chat: bool = False,
    ) -> EngineRequest:
        """An EngineRequest, or RequestError naming the problem. ``chat``: ``prompt`` is
        text rendered by the chat template (it carries its own special tokens)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        salt = None
        if isinstance(prompt, Mapping):
            unknown = sorted(set(prompt) - _PROMPT_KEYS)
            if unknown:
                raise RequestError(f"unsupported prompt field(s) {unknown}; ingot takes 'prompt' or 'prompt_token_ids'")
            if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
                raise RequestError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
            salt = prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise RequestError(f"cache_salt must be a string, got {type(salt).__name__}")
            prompt = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
        text, ids = self._prompt_ids(prompt, chat)
        self.check_params(params)
        return EngineRequest(request_id, text, ids, params, stream=stream, cache_salt=salt)

    def check_params(self, params: SamplingParams) -> None:
        """RequestError unless ``params`` fit this model (token ids in the vocabulary, a
        structured output xgrammar accepts); sets ``params.bad_words_token_ids``."""
        for name in ("logit_bias", "allowed_token_ids"):
            ids = getattr(params, name)
            if ids:
                self._check_vocab(name, list(ids))
        params.set_bad_words_token_ids(self._bad_words_ids(params.bad_words) if params.bad_words else None)
        if params.structured_outputs is not None:
            try:
                structured.check(params.structured_outputs)
            except ValueError as exc:
                raise RequestError(str(exc)) from None

    def _check_vocab(self, name: str, ids: list[int], what: str = "") -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"{name}{what} has token ids out of the vocabulary (its size is {self.vocab_size}, "
                               f"ids 0 to {self.vocab_size - 1}): {bad[:5]}", name)

    def _bad_words_ids(self, words: Sequence[str]) -> list[list[int]]:
        out: list[list[int]] = []
        for word in words:
            try:
                bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
                spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            except Exception as exc:  # the tokenizer's own error, for this word alone
                raise RequestError(f"bad_words: the tokenizer cannot encode {word!r}: {exc}", "bad_words") from None
            for ids in (bare, spaced) if bare and len(spaced) == len(bare) and spaced[0] != bare[0] else (bare,):
                if ids:  # (a word of characters the tokenizer drops bans nothing)
                    self._check_vocab("bad_words", ids, f" ({word!r})")
                    out.append(ids)
        return out

    def _prompt_ids(self, prompt: Any, chat: bool) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty")
            try:
                ids = self.tokenizer.encode(prompt, add_special_tokens=not chat)
            except Exception as exc:  # the tokenizer's own error, for this prompt alone
                raise RequestError(f"the tokenizer cannot encode this prompt: {exc}") from None
            text: Optional[str] = prompt
        elif isinstance(prompt, (list, tuple)) and set(map(type, prompt)) <= {int}:  # ids as JSON gives them
            ids = list(prompt)
            text = None
        elif isinstance(prompt, (list, tuple)) and all(_is_token(t) for t in prompt):
            ids = [int(t) for t in prompt]
            text = None
        else:
            raise RequestError(
                f"a prompt must be a string, a list of token ids or a prompt dict, got {type(prompt).__name__}"
            )
        if not ids:
            raise RequestError("prompt has no tokens")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            raise RequestError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                "it leaves no room to generate; shorten the prompt"
            )
        return text, ids

    def render_chat(self, conversation: Sequence[Message], **options: Any) -> str:
        """The chat template's text for ``conversation``; RequestError if it cannot be rendered."""
        try:
            return self.tokenizer.render_chat(conversation, **options)
        except ValueError as exc:
            raise RequestError(str(exc)) from None


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
