"""Request bodies of the OpenAI-compatible API, as pydantic models, and their SamplingParams.

Field names and defaults follow OpenAI's API, plus vLLM's extensions (sampling:
``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``,
``allowed_token_ids``, ``bad_words``; OpenAI's ``logit_bias``, its keys token ids as
strings and its values clamped to [-100, 100]; prompts: ``truncate_prompt_tokens``,
``prompt_logprobs``, ``add_special_tokens``; structured outputs; chat templates and their
kwargs). Every other field either API defines is refused by name when set to something
ingot cannot honour, and a field neither defines is ignored with one warning (``fields.py``).
"""

from __future__ import annotations

import json
from typing import Any, Callable, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, field_validator

from ingot.sampling_params import MAX_LOGPROBS, SamplingError, SamplingParams
from ingot.serve import fields


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="allow")
    refused_fields: ClassVar[dict[str, Callable[[Any], bool]]] = fields.COMPLETION_REFUSED

    model: Optional[str] = None
    n: int = 1
    best_of: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, FiniteFloat]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    response_format: Optional[dict[str, Any]] = None
    # vLLM's extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    cache_salt: Optional[str] = None
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    truncate_prompt_tokens: Optional[int] = None
    truncation_side: Optional[Literal["left", "right"]] = None
    request_id: Optional[str] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[dict[str, Any], str, bool]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    structural_tag: Optional[Union[str, dict[str, Any]]] = None
    guided_decoding_backend: Optional[str] = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, value: Optional[int]) -> Optional[int]:
        if value is not None and value != -1 and value < 1:
            raise ValueError("must be >= 1, or -1 for the context length")
        return value

    def refused(self) -> Optional[tuple[str, str]]:
        """(field, message) for a field ingot cannot honour; logs unknown fields once."""
        found = fields.refused(self.model_extra, self.refused_fields)
        if found is None and self.stream_options is not None:
            fields.warn_unknown(f"stream_options.{k}" for k in self.stream_options.model_extra or {})
        return found

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int], prompt_logprobs: Optional[int] = None,
                        **extra: Any) -> SamplingParams:
        """SamplingParams for this request (raises SamplingError naming a bad field); ``extra``
        sets more fields or replaces these."""
        fields_ = dict(
            n=self.n,
            best_of=self.best_of,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
        )
        return SamplingParams(**{**fields_, **extra})

    def _logit_bias(self) -> Optional[dict[int, float]]:
        """OpenAI's ``logit_bias`` (token ids as strings) as token id -> bias in [-100, 100]."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise SamplingError(f"logit_bias keys must be token ids (integers, as strings), got {key!r}") from None
            out[token] = min(100.0, max(-100.0, bias))
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk (vLLM's ``continuous_usage_stats``, with ``include_usage``)."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage
                    and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    # token ids first: pydantic's smart union takes the first strict match either way, but a
    # failed list[str] attempt on 545 ids built 545 errors first (79 -> 10 us per request)
    prompt: Union[list[int], str, list[list[int]], list[str]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = True

    def prompts(self) -> list[Union[str, list[int]]]:
        """The request's prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: Optional[str] = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def as_dict(self) -> dict[str, Any]:
        """The call as chat templates read it: ``arguments`` a mapping where the JSON allows
        (HF's templates write ``arguments | tojson``), as vLLM hands them over."""
        args: Any = self.function.arguments
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
                args = parsed if isinstance(parsed, dict) else args
            except ValueError:
                pass
        out: dict[str, Any] = {"type": "function", "function": {"name": self.function.name, "arguments": args}}
        if self.id is not None:
            out["id"] = self.id
        return out


class ChatMessage(BaseModel):
    """One message of the conversation. Fields beyond these (``reasoning_content``...)
    are handed to the chat template as they are."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None

    def problem(self) -> Optional[tuple[str, str]]:
        """(field, why) if this message is not one OpenAI's API accepts."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            what = "an assistant message needs content or tool_calls" if self.role == "assistant" else \
                f"a {self.role} message needs content (a string or a list of text parts), not null"
            return "content", what
        if self.role == "tool" and not self.tool_call_id:
            return "tool_call_id", "a tool message needs the tool_call_id of the call it answers"
        if self.tool_calls and self.role != "assistant":
            return "tool_calls", "only assistant messages carry tool_calls"
        return None

    def as_dict(self) -> dict[str, Any]:
        content: Any = self.content
        if isinstance(content, list):
            content = [p.model_dump(exclude_none=True) for p in content]
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {**(self.model_extra or {}), "role": role, "content": "" if content is None else content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.as_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    refused_fields: ClassVar[dict[str, Callable[[Any], bool]]] = fields.CHAT_REFUSED

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    reasoning_effort: Optional[str] = None
    include_reasoning: bool = True
    # vLLM's chat extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    documents: Optional[list[dict[str, Any]]] = None

    def problem(self) -> Optional[tuple[str, str]]:
        """(param, why) for a message the API does not accept."""
        for i, m in enumerate(self.messages):
            found = m.problem()
            if found is not None:
                return f"messages.{i}.{found[0]}", f"messages[{i}]: {found[1]}"
        return None

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template sees besides the messages: ``chat_template_kwargs``, and
        as vLLM passes them, ``documents`` and ``reasoning_effort`` (which also sets
        ``enable_thinking`` unless the kwargs do)."""
        kwargs: dict[str, Any] = {}
        if self.documents is not None:
            kwargs["documents"] = self.documents
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
            kwargs["enable_thinking"] = self.reasoning_effort != "none"
        kwargs.update(self.chat_template_kwargs or {})
        return kwargs

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    tools: Optional[list[Tool]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    tokens: list[int]
