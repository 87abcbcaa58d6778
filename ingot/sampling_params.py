"""SamplingParams: how one request's tokens are chosen and when it stops.

Every field is validated in ``__post_init__``; a bad value (wrong type, out of
range, NaN) raises ``SamplingError`` whose message names the field and the
allowed range. ``stop`` and ``stop_token_ids`` are normalised to lists.
``logit_bias``, ``allowed_token_ids`` and ``bad_words`` are checked for their form here and
against the model's vocabulary when a request is processed (``ingot.engine.request``), which
also tokenizes ``bad_words`` into ``bad_words_token_ids``.
``StructuredOutputsParams`` constrains the output to a grammar (vLLM's fields);
only its form is checked here: whether xgrammar accepts it is checked when a
request is processed (``ingot.engine.structured``).
"""

from __future__ import annotations

import json as _json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

# Below this temperature a request is decoded greedily.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_N = 128


class SamplingError(ValueError):
    """A sampling parameter is invalid (the message names the field and range)."""


def _is_int(value: Any) -> bool:
    t = type(value)
    if t is int:
        return True
    return t is not bool and isinstance(value, numbers.Integral)


def _is_real(value: Any) -> bool:
    t = type(value)
    if t is float or t is int:
        return True
    return t is not bool and isinstance(value, numbers.Real)


def _int(name: str, value: Any, allowed: str, lo: Optional[int] = None,
         hi: Optional[int] = None) -> int:
    if not _is_int(value):
        raise SamplingError(f"{name} must be an integer {allowed}, got {value!r}")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise SamplingError(f"{name} must be {allowed}, got {value!r}")
    return value


def _float(name: str, value: Any, allowed: str, ok) -> float:
    if not _is_real(value):
        raise SamplingError(f"{name} must be a number {allowed}, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or not ok(value):
        raise SamplingError(f"{name} must be {allowed}, got {value!r}")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SamplingError(f"{name} must be a bool (True or False), got {value!r}")
    return value


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """The output must follow one grammar (vLLM's ``StructuredOutputsParams``; xgrammar compiles it).

    Exactly one constraint is set: ``json`` (a JSON schema, as a dict or JSON text),
    ``regex``, ``choice`` (the output is one of these strings), ``grammar`` (xgrammar's
    EBNF), ``json_object`` (True: any JSON object) or ``structural_tag`` (xgrammar's
    structural tag, as JSON text or a dict). ``disable_any_whitespace``: JSON without
    free whitespace (one space after ``:`` and ``,``), so a model cannot pad it forever.
    ``whitespace_pattern`` is vLLM's field for backends that take one; xgrammar does not,
    so it must stay None.
    """

    json: Union[str, Dict[str, Any], None] = None
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Union[str, Dict[str, Any], None] = None
    disable_any_whitespace: bool = False
    whitespace_pattern: Optional[str] = None

    def __post_init__(self) -> None:
        if self.json_object is not None:
            self.json_object = _bool("structured_outputs.json_object", self.json_object)
        self.disable_any_whitespace = _bool("structured_outputs.disable_any_whitespace", self.disable_any_whitespace)
        if self.whitespace_pattern is not None:
            raise SamplingError("structured_outputs.whitespace_pattern is not supported (xgrammar takes no "
                                "whitespace pattern); use disable_any_whitespace=True for compact JSON")
        given = [name for name in _CONSTRAINTS
                 if getattr(self, name) is not None and getattr(self, name) is not False]
        if len(given) != 1:
            raise SamplingError(f"structured_outputs needs exactly one of {', '.join(_CONSTRAINTS)}; "
                                f"got {' and '.join(given) if given else 'none'}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or not all(isinstance(c, str) for c in self.choice):
                raise SamplingError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            self.choice = list(self.choice)
        kind = given[0]
        # what the compiled grammar depends on (a json_object is the schema of any object)
        self._key = ("json" if kind == "json_object" else kind, self._constraint_text(kind),
                     not self.disable_any_whitespace)

    def _constraint_text(self, kind: str) -> str:
        value = getattr(self, kind)
        if kind in ("json", "structural_tag"):
            if isinstance(value, str):
                try:
                    value = _json.loads(value)
                except ValueError as exc:
                    raise SamplingError(f"structured_outputs.{kind} is not valid JSON: {exc}") from None
            allowed = (dict, bool) if kind == "json" else (dict,)
            if not isinstance(value, allowed):
                what = "a JSON schema (an object or a boolean)" if kind == "json" else "a JSON object"
                raise SamplingError(f"structured_outputs.{kind} must be {what}, got {type(value).__name__}")
            try:  # canonical text, keys in the given order (a schema's property order is the output's)
                return _json.dumps(value, ensure_ascii=False, separators=(",", ":"))
            except (TypeError, ValueError) as exc:
                raise SamplingError(f"structured_outputs.{kind} is not JSON-serialisable: {exc}") from None
        if kind == "choice":
            return _json.dumps(value, ensure_ascii=False)
        if kind == "json_object":
            return '{"type":"object"}'
        return value

    @property
    def key(self) -> Tuple[str, str, bool]:
        """(kind, canonical text, any whitespace): equal constraints share one compilation."""
        return self._key


@dataclass
class SamplingParams:
    """Per-request sampling settings (vLLM-like names and meanings)."""

    n: int = 1  # samples of the prompt (they share its prefill and cached blocks)
    best_of: Optional[int] = None  # None or n (ingot returns every sample; more than n is not supported)
    temperature: float = 1.0  # >= 0; 0 means greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1 disables; else >= 1
    min_p: float = 0.0  # [0, 1]
    seed: Optional[int] = None  # per-request seed, independent of batch composition
    repetition_penalty: float = 1.0  # > 0; HF-style over prompt + output tokens
    presence_penalty: float = 0.0  # [-2, 2]; OpenAI-style over output tokens
    frequency_penalty: float = 0.0  # [-2, 2]; OpenAI-style over output tokens
    max_tokens: Optional[int] = 16  # >= 1; None = up to the context limit
    min_tokens: int = 0  # EOS / stop_token_ids are masked until this many tokens exist
    stop: Union[List[str], str, None] = None  # normalised to list[str]
    stop_token_ids: Optional[List[int]] = None  # normalised to list[int]
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # top-n logprobs per generated token, 0..20
    prompt_logprobs: Optional[int] = None  # top-n logprobs per prompt token, 0..20
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: Optional[StructuredOutputsParams] = None  # the output follows a grammar
    logit_bias: Optional[Dict[int, float]] = None  # token id -> added to its logit (before penalties)
    allowed_token_ids: Optional[List[int]] = None  # non-empty: every other token is excluded
    bad_words: Optional[List[str]] = None  # words never generated (as a whole token sequence)
    # bad_words as token id sequences, set when the request is processed (set_bad_words_token_ids)
    bad_words_token_ids: Optional[List[List[int]]] = field(default=None, init=False, repr=False, compare=False)
    # any of the three above to apply (what the sampler reads of them for every row, every step)
    has_token_rules: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.n = _int("n", self.n, f">= 1 (at most {MAX_N})", lo=1, hi=MAX_N)
        if self.best_of is not None:
            self.best_of = _int("best_of", self.best_of, f"None or equal to n={self.n}", lo=self.n, hi=self.n)
        self.temperature = _float("temperature", self.temperature, ">= 0", lambda v: v >= 0)
        self.top_p = _float("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1)
        if not _is_int(self.top_k) or not (int(self.top_k) in (0, -1) or int(self.top_k) >= 1):
            raise SamplingError(f"top_k must be an integer >= 1, or 0 / -1 to disable, got {self.top_k!r}")
        self.top_k = int(self.top_k)
        self.min_p = _float("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1)
        if self.seed is not None:
            self.seed = _int("seed", self.seed, "(any integer) or None")
        self.repetition_penalty = _float(
            "repetition_penalty", self.repetition_penalty, "> 0", lambda v: v > 0)
        self.presence_penalty = _float(
            "presence_penalty", self.presence_penalty, "in [-2, 2]", lambda v: -2 <= v <= 2)
        self.frequency_penalty = _float(
            "frequency_penalty", self.frequency_penalty, "in [-2, 2]", lambda v: -2 <= v <= 2)
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, ">= 1 (or None)", lo=1)
        self.min_tokens = _int("min_tokens", self.min_tokens, ">= 0", lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        self.stop = self._norm_stop(self.stop)
        self.stop_token_ids = self._norm_stop_ids(self.stop_token_ids)
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs,
                                 f"in [0, {MAX_LOGPROBS}] (or None)", lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs,
                                        f"in [0, {MAX_LOGPROBS}] (or None)", lo=0, hi=MAX_LOGPROBS)
        self.skip_special_tokens = _bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _bool(
            "include_stop_str_in_output", self.include_stop_str_in_output)
        so = self.structured_outputs
        if isinstance(so, dict):
            try:
                so = StructuredOutputsParams(**so)
            except TypeError as exc:
                raise SamplingError(f"structured_outputs: {exc}") from None
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise SamplingError(f"structured_outputs must be StructuredOutputsParams (or a dict of its fields), got {so!r}")
        self.structured_outputs = so
        self.logit_bias = self._norm_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = self._token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise SamplingError("allowed_token_ids must not be empty (None allows every token)")
        self.bad_words = self._norm_bad_words(self.bad_words)
        self.set_bad_words_token_ids(None)

    def set_bad_words_token_ids(self, ids: Optional[List[List[int]]]) -> None:
        """``bad_words`` as token id sequences (``InputProcessor`` tokenizes them; the sampler
        bans them); also brings ``has_token_rules`` up to date."""
        self.bad_words_token_ids = ids
        self.has_token_rules = bool(self.logit_bias or self.allowed_token_ids or ids)

    @staticmethod
    def _norm_stop(stop: Any) -> List[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise SamplingError(f"stop must be a non-empty string, a list of them, or None, got {stop!r}")
        out = []
        for s in stop:
            if not isinstance(s, str) or not s:
                raise SamplingError(f"stop must contain only non-empty strings, got {s!r}")
            out.append(s)
        return out

    @staticmethod
    def _norm_stop_ids(ids: Any) -> List[int]:
        if ids is None:
            return []
        if _is_int(ids):
            ids = [ids]
        if not isinstance(ids, (list, tuple)):
            raise SamplingError(f"stop_token_ids must be a list of integers >= 0, or None, got {ids!r}")
        out = []
        for t in ids:
            if not _is_int(t) or int(t) < 0:
                raise SamplingError(f"stop_token_ids must contain only integers >= 0, got {t!r}")
            out.append(int(t))
        return out

    @staticmethod
    def _token_ids(name: str, ids: Any) -> List[int]:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
            raise SamplingError(f"{name} must be a list of token ids (integers), or None, got {ids!r}")
        bad = [t for t in ids if not _is_int(t)]
        if bad:
            raise SamplingError(f"{name} must contain only token ids (integers), got {bad[0]!r}")
        return [int(t) for t in ids]

    @staticmethod
    def _norm_logit_bias(bias: Any) -> Optional[Dict[int, float]]:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise SamplingError(f"logit_bias must be a dict of token id -> bias, or None, got {bias!r}")
        out = {}
        for t, b in bias.items():
            if not _is_int(t):
                raise SamplingError(f"logit_bias keys must be token ids (integers), got {t!r}")
            out[int(t)] = _float("logit_bias", b, f"a finite number (the bias of token {t})", lambda v: True)
        return out

    @staticmethod
    def _norm_bad_words(words: Any) -> Optional[List[str]]:
        if words is None:
            return None
        if isinstance(words, str) or not isinstance(words, (list, tuple)):
            raise SamplingError(f"bad_words must be a list of strings, or None, got {words!r}")
        for w in words:
            if not isinstance(w, str) or not w.strip():
                raise SamplingError(f"bad_words must contain only strings with a non-space character, got {w!r}")
        return list(words)

    @property
    def greedy(self) -> bool:
        """Whether this request is decoded by argmax (temperature ~ 0)."""
        return self.temperature < GREEDY_EPS
