"""What generate() returns, shaped like vLLM's outputs: RequestOutput with CompletionOutputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class Logprob:
    """One token's log probability, its rank in the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# Per position: the sampled (or prompt) token and the top-n alternatives, each keyed by token id.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[Optional[dict[int, Logprob]]]  # None for the first prompt token


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's ``n`` samples."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None  # sum of the sampled tokens' logprobs (with ``logprobs``)
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: Optional[object] = None  # the stop string or token id that ended it
    delta: str = ""  # text added since the previous output of this request (streaming)
    delta_token_ids: list[int] = field(default_factory=list)  # token ids added since then

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.time()``) of one request's milestones."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0
    # speculative decoding, over the request's samples: verify steps with drafts, drafted
    # tokens, and the drafted tokens kept
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def time_in_queue(self) -> Optional[float]:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def spec_acceptance_rate(self) -> Optional[float]:
        """Drafted tokens kept / drafted (None without drafts)."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else None

    @property
    def spec_mean_accepted_length(self) -> Optional[float]:
        """Drafted tokens kept per draft (None without drafts); each verify step also emits one more."""
        return self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: Optional[str] = None  # set when this request failed; other requests are unaffected
    prompt_logprobs: Optional[PromptLogprobs] = None
    metrics: Optional[RequestMetrics] = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def delta(self) -> str:
        """The first sample's new text (streaming a request with ``n=1``)."""
        return self.outputs[0].delta if self.outputs else ""
