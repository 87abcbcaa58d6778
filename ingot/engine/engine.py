"""Engine: the step loop. Admits requests, schedules, runs the model, applies stop rules.

Bad requests are rejected at ``add_request`` with a RequestError naming the
problem; nothing already admitted is affected.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Optional, Sequence as Seq, Union

import torch

from ingot.config import ConfigError, EngineConfig
from ingot.engine.block_manager import BlockManager
from ingot.runner.kv_pool import blocks_for
from ingot.runner.sampler import make_generator
from ingot.engine.scheduler import Scheduler
from ingot.engine.sequence import Sequence
from ingot.loading.checkpoint import open_checkpoint
from ingot.loading.tokenizer import IncrementalDetokenizer, Tokenizer, add_tokens
from ingot.models.loader import load_checkpoint, resolve_device, resolve_dtype
from ingot.loading.model_config import ModelConfig
from ingot.runner.model_runner import ModelRunner
from ingot.sampling_params import SamplingParams

log = logging.getLogger(__name__)

Prompt = Union[str, Seq[int]]


class RequestError(ValueError):
    """One request is invalid (empty, too long, bad token ids...). Other requests are unaffected."""


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.eos_token_ids = tuple(dict.fromkeys([*model_config.eos_token_ids, *tokenizer.eos_token_ids]))
        self.runner = ModelRunner(model, model_config, config, device, dtype)
        num_blocks = self.runner.num_kv_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        blocks = BlockManager(num_blocks, config.block_size)
        if max_model_len > blocks.capacity_tokens:
            if config.max_model_len is not None:
                raise ConfigError(
                    f"max_model_len={max_model_len} exceeds the KV cache ({blocks.capacity_tokens} tokens); "
                    "lower it or give the cache more memory"
                )
            log.warning("max_model_len lowered from %d to the KV cache capacity %d", max_model_len, blocks.capacity_tokens)
            max_model_len = blocks.capacity_tokens
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner.setup_decode_graphs(blocks_for(max_model_len, config.block_size))
        self._ids = itertools.count()
        self.requests: dict[str, Sequence] = {}

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Engine":
        ckpt = open_checkpoint(config.model, config.tokenizer)
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device, ckpt.config.torch_dtype)
        mcfg = ckpt.config
        max_len = config.max_model_len or mcfg.max_position_embeddings
        if mcfg.sliding_window is not None and mcfg.sliding_window < max_len:
            raise ConfigError(
                f"{mcfg.architecture} uses a sliding attention window of {mcfg.sliding_window} tokens, "
                f"which ingot does not implement yet; pass max_model_len={mcfg.sliding_window} (or less)"
            )
        model = load_checkpoint(ckpt, dtype, device, max_len, progress=config.show_progress)
        return cls(config, model, mcfg, ckpt.tokenizer, device, dtype, max_len)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: Prompt,
        params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        *,
        chat: bool = False,
        stream: bool = True,
    ) -> Sequence:
        """Validate and queue one request; raises RequestError (nothing else changes) if bad.

        ``stream=False``: the caller reads the text only once the request has finished,
        so without stop strings its tokens are detokenized once, at the end, instead of
        every step (``seq.text`` and ``seq.delta`` stay empty until then).
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text, ids = self._prompt_ids(prompt, chat)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        gen = make_generator(params.seed, self.device) if params.seed is not None else None
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        seq = Sequence(request_id, text, ids, params, detok, gen)
        seq.lazy_text = not stream and not params.stop
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _prompt_ids(self, prompt: Prompt, chat: bool) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty")
            ids = self.tokenizer.encode(prompt, add_special_tokens=not chat)
            text: Optional[str] = prompt
        else:
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise RequestError("a prompt must be a string or a list of token ids") from None
            text = None
        if not ids:
            raise RequestError("prompt has no tokens")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                "it leaves no room to generate; shorten the prompt"
            )
        return text, ids

    def abort(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is not None and not seq.finished:
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)
            self._flush_text([seq])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ step
    def step(self) -> list[Sequence]:
        """Run one model step; returns the sequences that got a new token (or finished)."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        rows, out = self.runner.execute(batch, self.eos_token_ids)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        touched = [batch.seqs[row] for row in rows]
        eager = [k for k, seq in enumerate(touched) if not seq.lazy_text]
        if eager:
            add_tokens([touched[k].detok for k in eager], [[out.token_ids[k]] for k in eager])  # one batched detokenize
        now = time.monotonic()
        finished = []
        for seq, token, logprobs in zip(touched, out.token_ids, out.logprobs):
            if seq.lazy_text:
                seq.detok.defer([token])
            if self._append(seq, token, logprobs, now):
                finished.append(seq)
        self._flush_text(finished)
        return touched

    @staticmethod
    def _flush_text(finished: list[Sequence]) -> None:
        """The deferred text of finished ``lazy_text`` sequences, in one batched decode."""
        lazy = [seq for seq in finished if seq.lazy_text]
        if lazy:
            add_tokens([seq.detok for seq in lazy], [[] for _ in lazy], final=True)
            for seq in lazy:
                seq.text = seq.delta = seq.detok.text

    def _append(self, seq: Sequence, token: int, logprobs: Optional[dict[int, float]], now: float) -> bool:
        """Record a sampled token (already detokenized into ``seq.detok``) at time ``now`` and
        apply the stop rules; True if the sequence finished."""
        p = seq.params
        seq.output_token_ids.append(token)
        seq.token_times.append(now)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
        n_out = len(seq.output_token_ids)
        reason: Optional[str] = None
        stop_reason: Optional[object] = None
        text = seq.detok.text
        if not p.ignore_eos and token in self.eos_token_ids and n_out > p.min_tokens:
            reason = "stop"
        elif token in p.stop_token_ids and n_out > p.min_tokens:
            reason, stop_reason = "stop", token
        elif p.stop and n_out > p.min_tokens:
            hit = _find_stop(text, p.stop, len(seq.text))
            if hit is not None:
                pos, s = hit
                text = text[: pos + len(s)] if p.include_stop_str_in_output else text[:pos]
                reason, stop_reason = "stop", s
        if reason is None and ((p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is None and p.stop:
            hold = max(len(s) for s in p.stop) - 1  # a stop string may still be forming
            visible = text[: max(len(seq.text), len(text) - hold)]
        else:
            visible = text
        seq.delta = visible[len(seq.text) :]
        seq.text = visible
        if reason is None:
            return False
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)
        return True


def _find_stop(text: str, stops: list[str], already: int) -> Optional[tuple[int, str]]:
    """Earliest stop string in ``text`` that ends past the already-emitted prefix."""
    best: Optional[tuple[int, str]] = None
    for s in stops:
        pos = text.find(s, max(0, already - len(s) + 1))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, s)
    return best
