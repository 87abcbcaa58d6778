"""What generate() returns, vLLM-shaped: RequestOutput with CompletionOutputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: Optional[object] = None  # the stop string or token id that ended it
    logprobs: Optional[list[dict[int, float]]] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: Optional[str] = None  # set when this request was rejected; others are unaffected
    delta: str = ""  # text added by the last step (streaming)
