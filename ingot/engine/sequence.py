"""One request's state as it moves through the scheduler."""

from __future__ import annotations

import array
import enum
import itertools
import time
from typing import TYPE_CHECKING, Optional

import torch

from ingot.loading.tokenizer import IncrementalDetokenizer
from ingot.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ingot.engine.ngram import SpecState
    from ingot.engine.structured import SequenceGrammar

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

    Prefix caching (``engine/block_manager.py``): ``cache_salt`` keeps tenants'
    cached blocks apart (blocks of different salts never match); ``wait_for``
    holds a waiting sequence back until that sequence has computed its prompt,
    so that the n > 1 children of one prompt reuse its prompt blocks instead of
    all computing them in the same step.
    """

    def __init__(
        self,
        request_id: str,
        prompt: Optional[str],
        prompt_token_ids: list[int],
        params: SamplingParams,
        detok: IncrementalDetokenizer,
        generator: Optional[torch.Generator] = None,
        index: int = 0,
        cache_salt: Optional[str] = None,
        wait_for: Optional["Sequence"] = None,
    ) -> None:
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n samples
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.detok = detok
        self.generator = generator
        # int32 array, not a list: the step's block table is a memcpy of each row
        self.block_ids: array.array = array.array("i")
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.wait_for = wait_for
        # chained hashes of this sequence's full blocks, in order (computed once: tokens never change)
        self.block_hashes: list[bytes] = []
        # tokens sampled by a step still in flight (overlap scheduling): counted, not yet known
        self.num_pending = 0
        self.done_after_pending = False  # the pending token is its last (max_tokens, context)
        self.num_cached_blocks = 0  # leading block_ids that are in the prefix cache (hit or registered)
        self.num_dropped_blocks = 0  # leading block_ids handed back outside a sliding window (now the dummy)
        self.status = Status.WAITING
        self.arrival_time = time.monotonic()
        self.first_token_time: Optional[float] = None
        self.token_times: list[float] = []  # time.monotonic() of each output token
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[object] = None
        # per output token: (token, logprob, rank) of the sampled token, then the top-n
        self.logprobs: Optional[list[list[tuple[int, float, int]]]] = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # per prompt token: None for the first, then (token, logprob, rank) entries as for outputs
        self.prompt_logprobs: Optional[list] = [None] if params.prompt_logprobs is not None else None
        self.num_cached_tokens = 0  # prompt tokens whose KV came from the prefix cache (first admission)
        self.first_scheduled_time: Optional[float] = None
        self.num_preemptions = 0
        self.text = ""  # output text so far (stop strings already cut)
        self.delta = ""  # text added by the last step
        self.emitted_text = 0  # characters of ``text`` already in an output
        self.emitted_tokens = 0  # output tokens already in an output
        self.error: Optional[str] = None  # why it failed (finish_reason "error")
        # no reader of per-step text (no streaming, no stop strings): the tokens are
        # detokenized once, when the sequence finishes (Engine.step)
        self.lazy_text = False
        # structured outputs: its grammar matcher (set when the request's grammar is compiled)
        self.grammar: Optional["SequenceGrammar"] = None
        # speculative decoding: the tokens proposed for its next step (read by the scheduler),
        # and its proposer's state and acceptance counts (``engine/speculative.py``)
        self.draft_token_ids: list[int] = []
        self.spec: Optional["SpecState"] = None
        # with a draft model: its leading tokens whose draft K/V is in the draft's pool (the
        # frontier ``engine/speculative.py`` keeps; ``runner/batch.py``), and the leading blocks
        # the block manager has marked as holding it
        self.draft_kv_len = 0
        self.num_draft_blocks = 0

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, the ones still pending on the device included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

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


def needs_history(seqs: list[Sequence]) -> bool:
    """Does sampling any of ``seqs`` need tokens still pending on the device (penalties read
    the output so far, ``min_tokens`` its length, a bad word of several tokens its end)?"""
    for seq in seqs:
        if seq.num_pending:
            p = seq.params
            if p.min_tokens or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
                return True
            if p.bad_words_token_ids and any(len(w) > 1 for w in p.bad_words_token_ids):
                return True
    return False
