"""One request's state as it moves through the scheduler."""

from __future__ import annotations

import array
import enum
import itertools
import time
from typing import Optional

import torch

from ingot.loading.tokenizer import IncrementalDetokenizer
from ingot.sampling_params import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens, KV blocks and progress of one request.

    Invariant: the KV of tokens ``[0, num_computed_tokens)`` is in the cache.
    A sequence is in prefill while more than its last token is uncomputed; in
    decode it has exactly one (the last sampled) token to compute.
    """

    def __init__(
        self,
        request_id: str,
        prompt: Optional[str],
        prompt_token_ids: list[int],
        params: SamplingParams,
        detok: IncrementalDetokenizer,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.detok = detok
        self.generator = generator
        # int32 array, not a list: the step's block table is a memcpy of each row
        self.block_ids: array.array = array.array("i")
        self.num_computed_tokens = 0
        self.status = Status.WAITING
        self.arrival_time = time.monotonic()
        self.first_token_time: Optional[float] = None
        self.token_times: list[float] = []  # time.monotonic() of each output token
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[object] = None
        self.logprobs: Optional[list[dict[int, float]]] = [] if params.logprobs is not None else None
        self.num_preemptions = 0
        self.text = ""  # output text so far (stop strings already cut)
        self.delta = ""  # text added by the last step
        # no reader of per-step text (no streaming, no stop strings): the tokens are
        # detokenized once, when the sequence finishes (Engine.step)
        self.lazy_text = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output, without joining the two lists.

        Called for every sequence on every step: a decode step needs only the
        last token, so building the whole token list there would cost O(length).
        """
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"Sequence({self.request_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, {self.status.value})"
