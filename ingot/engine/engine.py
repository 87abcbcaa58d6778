"""Engine: the synchronous core. Admits requests, schedules, runs the model, applies stop rules.

One thread at a time may call ``add``, ``abort`` and ``step``: the engine loop
(``engine_loop.py``) is that thread when several callers share an engine.
Requests arrive validated (``request.InputProcessor``); anything that still
fails inside a step (detokenizing, sampling, a stop check, even the forward)
fails the requests it concerns, with ``RequestOutput.error``, and the engine
goes on.
"""

from __future__ import annotations

import functools
import gc
import itertools
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Iterable, Optional, Union

import torch

from ingot.config import ConfigError, EngineConfig
from ingot.engine.block_manager import BlockManager
from ingot.engine.outputs import RequestState, build_output, record_prompt_logprobs
from ingot.engine.reasoning import reasoning_tags
from ingot.engine.request import EngineRequest, InputProcessor, Prompt, RequestError
from ingot.engine.scheduler import Scheduler
from ingot.engine.sequence import Sequence, needs_history
from ingot.engine.speculative import make_speculator
from ingot.engine.stop_rules import append_token, detokenize, flush_text
from ingot.engine.stats import EngineInfo, EngineStats
from ingot.engine.structured import Grammars, NextMasks, advance
from ingot.loading.model_config import ModelConfig
from ingot.loading.tokenizer import IncrementalDetokenizer, Tokenizer
from ingot.models.loader import open_model
from ingot.outputs import RequestOutput
from ingot.runner.batch import ScheduledBatch
from ingot.runner.executor import Executor, create_executor
from ingot.runner.kv_pool import blocks_for
from ingot.runner.model_runner import LaunchedStep, TokenFeed
from ingot.sampling_params import SamplingParams

log = logging.getLogger(__name__)

__all__ = ["Engine", "RequestError", "Prompt"]

_GOLDEN = 0x9E3779B97F4A7C15  # spreads the seeds of a request's n samples


class Engine:
    """The one way to build an engine: ``Engine(config)`` opens the model, loads it through
    an executor (one device or a tensor-parallel group), sizes and allocates the KV pool and
    captures the decode graphs."""

    def __init__(self, config: EngineConfig) -> None:
        ckpt = open_model(config)
        mcfg = ckpt.config
        max_model_len = config.max_model_len or ckpt.max_model_len or mcfg.max_position_embeddings
        self.executor: Executor = create_executor(config, ckpt, max_model_len)
        try:
            self._start(self.executor.config, mcfg, ckpt.tokenizer, max_model_len)
        except BaseException:
            self.executor.close()
            raise

    def _start(self, config: EngineConfig, model_config: ModelConfig, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.config = config  # the device's defaults (max_num_seqs) resolved
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(dict.fromkeys([*model_config.eos_token_ids, *tokenizer.eos_token_ids]))
        # a reasoning parser's tags, checked before the KV pool and the graphs
        tags = reasoning_tags(config.reasoning_parser, tokenizer) if config.reasoning_parser is not None else None
        num_blocks = self.executor.num_kv_blocks()
        self.executor.allocate_kv_cache(num_blocks)
        spec = config.speculative_config
        blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, model_config.kv_window,
                              draft_kv=spec is not None and spec.uses_draft_model)
        if max_model_len > blocks.capacity_tokens:
            if config.max_model_len is not None:
                raise ConfigError(
                    f"max_model_len={max_model_len} exceeds the KV cache ({blocks.capacity_tokens} tokens); "
                    "lower it or give the cache more memory"
                )
            log.warning("max_model_len lowered from %d to the KV cache capacity %d", max_model_len, blocks.capacity_tokens)
            max_model_len = blocks.capacity_tokens
        self.max_model_len = max_model_len
        self.spec = make_speculator(spec, max_model_len) if spec is not None else None
        self.scheduler = Scheduler(blocks, config.max_num_seqs, config.max_num_batched_tokens, config.prefill_wave_tokens)
        self.executor.setup_decode_graphs(blocks_for(max_model_len, config.block_size))
        self.inputs = InputProcessor(tokenizer, model_config.vocab_size, max_model_len)
        cuda = self.executor.device.type == "cuda"
        self.grammars = Grammars(tokenizer, model_config.vocab_size, self.eos_token_ids, pin_memory=cuda, reasoning=tags,
                                 ahead=cuda)
        self._ids = itertools.count()
        self.requests: dict[str, RequestState] = {}
        self._inflight: Optional[_InFlight] = None  # a step queued but not read back (overlap)
        self.prompt_tokens = 0  # admitted, since start
        self.generation_tokens = 0  # sampled, since start

    def close(self) -> None:
        """Release the executor's processes (tensor-parallel workers); the engine is unusable after."""
        self.grammars.close()
        self.executor.close()

    def release(self) -> None:
        """After ``close``: drop the executor (the model, the KV cache, the graphs), so its device
        memory goes to a next engine in the process even while this object stays referenced."""
        executor = self.__dict__.pop("executor", None)
        if executor is None:  # released already
            return
        cuda = executor.device.type == "cuda"
        self._inflight = None
        del executor
        gc.collect()  # a cycle through the model would keep the KV cache until the next collection
        if cuda:
            torch.cuda.empty_cache()  # the allocator's cached blocks: free memory for a next engine's budget

    # ------------------------------------------------------------------ requests
    def new_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self,
        prompt: Prompt,
        params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        *,
        chat: bool = False,
        stream: bool = True,
    ) -> Sequence:
        """Validate and queue one request; returns its first sample's Sequence (the one a
        request with ``n=1`` has). Raises RequestError (and changes nothing) if it is bad.

        ``stream=False``: the caller reads the text only once the request has finished,
        so without stop strings its tokens are detokenized once, at the end, instead of
        every step (``seq.text`` and ``seq.delta`` stay empty until then).
        """
        rid = self.new_request_id() if request_id is None else request_id
        return self.add(self.inputs.process(prompt, params, rid, stream=stream, chat=chat)).seqs[0]

    def add(self, request: EngineRequest) -> RequestState:
        """Queue a processed request; RequestError if its id is in use."""
        if request.request_id in self.requests:
            raise RequestError(f"request id {request.request_id!r} is already in use")
        p = request.params
        seqs = []
        for i in range(p.n):
            gen = self.executor.generator(p.seed + i * _GOLDEN) if p.seed is not None else None
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, p.skip_special_tokens)
            # samples 2..n wait until sample 1 has computed (and cached) the shared prompt
            seq = Sequence(request.request_id, request.prompt, request.prompt_token_ids, p, detok, gen, index=i,
                           cache_salt=request.cache_salt, wait_for=seqs[0] if seqs else None)
            seq.arrival_time = request.arrival_time
            seq.lazy_text = not request.stream and not p.stop
            seqs.append(seq)
        state = RequestState(request, seqs)
        self.requests[request.request_id] = state
        self.prompt_tokens += len(request.prompt_token_ids)
        if p.structured_outputs is not None:  # queued once its grammar is compiled (step)
            self.grammars.hold(request.request_id, p.structured_outputs, state)
            return state
        for seq in seqs:
            self.scheduler.add(seq)
        return state

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        """Stop a request wherever it is and free its blocks; its final output (None if unknown)."""
        state = self.requests.get(request_id)
        return None if state is None else self._finish_request(state, "abort")

    def fail(self, request_id: str, message: str) -> Optional[RequestOutput]:
        """End a request with ``message`` as its error (as ``abort`` otherwise)."""
        state = self.requests.get(request_id)
        return None if state is None else self._finish_request(state, "error", message)

    def info(self) -> EngineInfo:
        blocks = self.scheduler.blocks
        return EngineInfo(self.max_model_len, self.model_config.vocab_size, self.config.max_num_seqs,
                          blocks.num_blocks - 1, blocks.capacity_tokens)

    def stats(self) -> EngineStats:
        """Load and counters now (cheap; any thread may read it, values may be a step old)."""
        sched = self.scheduler
        blocks = sched.blocks
        usable = blocks.num_blocks - 1
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + self.grammars.num_held,
            kv_cache_usage=(usable - blocks.num_free) / usable if usable else 0.0,
            num_preemptions=sched.stats.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            prefix_cache_queries=sched.stats.prefix_cache_queries,
            prefix_cache_hits=sched.stats.prefix_cache_hits,
            prefill_steps=sched.stats.prefill_steps,
            decode_steps=sched.stats.decode_steps,
            decode_rows=sched.stats.decode_rows,
            **(self.spec.counters() if self.spec is not None else {}),
        )

    def _finish_request(self, state: RequestState, reason: str, error: Optional[str] = None) -> RequestOutput:
        """End every unfinished sample of ``state`` with ``reason`` and retire the request."""
        ending = [s for s in state.seqs if not s.finished]
        for seq in ending:
            seq.finish_reason = reason
            if error is not None:
                seq.error = error
            self.scheduler.finish(seq)
        flush_text(ending, ended_early=True)
        return self._retire(state)

    def _retire(self, state: RequestState) -> RequestOutput:
        self.requests.pop(state.request.request_id, None)
        self.grammars.release(state.request.request_id)
        return build_output(state, self.tokenizer)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one model step; the outputs of the requests it advanced (streaming requests:
        each one that got a token; the others: only when they finish).

        With ``overlap_scheduling`` a step is queued on the device before the previous one
        is read back: the host schedules and prepares step n+1 while the GPU runs step n,
        step n+1 reads the tokens step n sampled on the device, and this call returns step
        n's outputs. A sequence that step n finished (a stop) has an extra token in step
        n+1, dropped. A step whose sampling needs the host to know those tokens (penalties,
        ``min_tokens``, bad words of several tokens) waits for step n first. Grammar rows
        need them only for their mask: step n+1's forward is queued first, then step n is
        read back (``Grammars.token_mask``); with ``Grammars.ahead`` a thread reads step n
        back as soon as its tokens are there, advances their matchers and fills step n+1's
        rows meanwhile (``_InFlight.run_ahead``).
        """
        outputs = self.grammars.admit(self.scheduler.add, self._finish_request) if self.grammars.num_held else []
        prev, self._inflight = self._inflight, None
        running = self.scheduler.running
        speculate = self.spec is not None and self.spec.wanted(running)
        # read back first (before scheduling: a sequence it stops must not be scheduled) when
        # the sampling of a sequence with a pending token reads the output so far, or to propose
        if prev is not None and (speculate or needs_history(running)):
            outputs += self._finish(prev)
            prev = None
        if self.spec is not None:
            self.spec.propose(running, speculate)
        batch = self.scheduler.schedule()
        if prev is not None and (batch is None or not self.config.overlap_scheduling):
            outputs += self._finish(prev)
            prev = None
        if batch is None:
            if not outputs and self.grammars.num_held:
                self.grammars.wait(0.01)  # nothing else to run: a grammar is compiling
            return outputs
        flight = self._launch(batch, prev)
        if prev is not None:
            outputs += self._finish(prev)
        if isinstance(flight, list):  # the launch failed: those requests' outputs
            return outputs + flight
        if self.config.overlap_scheduling and flight.step.sample is not None and batch.draft_tokens is None:
            self._inflight = flight
            if self.grammars.ahead:
                flight.run_ahead(self.grammars, self.eos_token_ids)
        else:
            outputs += self._finish(flight)
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.requests) or self._inflight is not None

    # ------------------------------------------------------------------ serving options
    def reset_prefix_cache(self) -> bool:
        """Forget every block in the prefix cache, so no later request hits KV computed
        before (vLLM's call of that name). Only on an idle engine: False, and nothing
        changes, while requests are in flight (their blocks would be registered later)."""
        if not self._settle_idle():
            return False
        return self.scheduler.blocks.reset_cache()

    def _settle_idle(self) -> bool:
        """Is no request in flight? If so, a step still queued for requests that have all
        ended (overlap: launched before a stop was read back) is read back first, so nothing
        is left in flight either."""
        if self.requests or self.scheduler.has_work():
            return False
        while self._inflight is not None:
            self.step()
        return True

    def _launch(self, batch: ScheduledBatch, prev: Optional["_InFlight"]) -> Union["_InFlight", list[RequestOutput]]:
        """Queue ``batch`` on the device (its last tokens from ``prev`` where they are still
        there); the step's record, or the failed requests' outputs."""
        now_wall = time.time()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now_wall
        feed = None
        if prev is not None:
            src = [prev.row_of.get(id(seq), -1) if seq.num_pending else -1 for seq in batch.seqs]
            if any(i >= 0 for i in src):
                feed = TokenFeed(prev.step.tokens, src)
        constrained = self.grammars.compiles > 0 and any(seq.grammar is not None for seq in batch.seqs)
        if constrained:  # the mask, once the forward is queued; a previous token it needs is read first
            wait = prev.advance_grammars if prev is not None else None
            batch.token_mask = functools.partial(self.grammars.token_mask, batch.seqs, self.eos_token_ids, wait)
        if self.spec is not None:
            self.spec.plan(batch, self.scheduler.running)
        try:
            step = self.executor.launch(batch, self.eos_token_ids, feed)
        except Exception as exc:  # the forward itself failed: these requests fail, the engine goes on
            log.exception("a step of %d sequences failed", len(batch.seqs))
            return self._fail_batch(batch, f"the model step failed: {type(exc).__name__}: {exc}")
        finally:
            batch.token_mask = None  # (it holds the previous step)
        computed = self.scheduler.on_step_launched(batch)
        if self.spec is not None:
            self.spec.launched(batch)
        sampled = [batch.seqs[row] for row in step.rows]
        # serially (and around verify steps) nothing is ever scheduled with a token pending
        pending = self.config.overlap_scheduling and batch.draft_tokens is None
        if pending:
            max_len = self.max_model_len
            for seq in sampled:
                seq.num_pending += 1
                p = seq.params
                seq.done_after_pending = (p.max_tokens is not None and len(seq.output_token_ids) + seq.num_pending >= p.max_tokens) \
                    or seq.num_tokens >= max_len
        return _InFlight(batch, step, computed, sampled, pending, constrained)

    def _finish(self, flight: "_InFlight") -> list[RequestOutput]:
        """Read a launched step back: its tokens, stop rules, outputs."""
        if flight.batch.draft_tokens is not None and self.spec is not None:
            return self.spec.finish(self, flight)
        batch, touched = flight.batch, flight.sampled
        if flight.pending:
            for seq in touched:
                seq.num_pending -= 1
        if flight.grammar_rows:
            flight.advance_grammars()  # (with an ahead thread: waits for it, which read the step back)
        try:
            out = flight.step.collect()
        except Exception as exc:
            log.exception("reading back a step of %d sequences failed", len(batch.seqs))
            return self._fail_batch(batch, f"the model step failed: {type(exc).__name__}: {exc}")
        if out.prompt_logprobs:
            record_prompt_logprobs(batch, out.prompt_logprobs, flight.computed)
        self.scheduler.on_step_done(batch, flight.computed)
        self.generation_tokens += len(touched)
        errors = out.errors or [None] * len(touched)
        if flight.grammar_rows:
            errors = [e or (s.grammar.error if s.grammar is not None else None) for e, s in zip(errors, touched)]
        return self._outputs(self._apply(touched, out.token_ids, out.logprobs, errors).values())

    def _apply(self, touched: list[Sequence], tokens: list[int], lps: list, errors: list) -> dict[str, RequestState]:
        """One token per sequence: detokenize, record, stop rules (or fail the sequence with
        its error); the requests changed."""
        ok = [k for k, e in enumerate(errors) if e is None and not touched[k].finished]
        detokenize([touched[k] for k in ok], [tokens[k] for k in ok], errors, ok)
        now = time.monotonic()
        changed: dict[str, RequestState] = {}
        for seq, token, logprobs, error in zip(touched, tokens, lps, errors):
            state = self.requests.get(seq.request_id)
            if state is None or seq.finished:
                continue
            changed[seq.request_id] = state
            if error is None:
                try:
                    if append_token(seq, token, logprobs, now, self.eos_token_ids, self.max_model_len):
                        self.scheduler.finish(seq)
                    continue
                except Exception as exc:
                    log.exception("request %s: stop check failed", seq.request_id)
                    error = f"{type(exc).__name__}: {exc}"
            seq.error = error
            seq.finish_reason = "error"
            self.scheduler.finish(seq)
        return changed

    def _fail_batch(self, batch: ScheduledBatch, message: str) -> list[RequestOutput]:
        outputs = []
        for rid in dict.fromkeys(seq.request_id for seq in batch.seqs):
            state = self.requests.get(rid)
            if state is not None:
                outputs.append(self._finish_request(state, "error", message))
        return outputs

    def _outputs(self, states: Iterable[RequestState]) -> list[RequestOutput]:
        done = []
        outputs = []
        tokenizer = self.tokenizer
        for state in states:
            if state.finished:
                done.append(state)
            elif state.request.stream:
                outputs.append(build_output(state, tokenizer))
        if done:
            flush_text([seq for state in done for seq in state.seqs])  # one batched decode
            outputs += [self._retire(state) for state in done]
        return outputs

@dataclass
class _InFlight:
    """A step queued on the device and not yet read back."""

    batch: ScheduledBatch
    step: LaunchedStep
    computed: list[int]  # per row: computed tokens once launched (what on_step_done may cache)
    sampled: list[Sequence]  # the rows that sample, in the order of the step's tokens
    pending: bool  # their tokens were counted as pending (overlap scheduling)
    grammar_rows: bool = False  # some rows sample with a grammar
    advanced: bool = False  # their matchers have accepted the step's tokens (or the ahead thread will)
    ahead: Optional[Future] = None  # the ahead thread's job (run_ahead): its NextMasks

    def advance_grammars(self) -> Optional[NextMasks]:
        """The step's tokens into their sequences' matchers, once: at read-back, or earlier
        when the next step's mask needs them (the device runs the next forward meanwhile).
        With an ahead thread, its job's end: the next step's rows it filled (None if it filled none)."""
        if self.ahead is not None:
            return self.ahead.result()
        if self.grammar_rows and not self.advanced:
            self.advanced = True
            try:
                out = self.step.collect()
            except Exception:
                return None  # the step failed: _finish fails its requests
            advance(self.sampled, out.token_ids, out.errors)
        return None

    def run_ahead(self, grammars: Grammars, stop_ids: tuple[int, ...]) -> None:
        """Hand the step's read-back, its matchers' advance and the next step's rows of its
        sequences (``Grammars.fill_ahead``) to the ahead thread; the engine loop touches those
        matchers again only after ``advance_grammars`` (the next mask, or this step's read-back)."""
        if self.grammar_rows and not self.advanced:
            self.advanced = True
            self.ahead = grammars.run_ahead(functools.partial(self._advance_and_fill, grammars, stop_ids))

    def _advance_and_fill(self, grammars: Grammars, stop_ids: tuple[int, ...]) -> Optional[NextMasks]:
        try:
            out = self.step.collect()
        except Exception:
            return None  # the step failed: _finish fails its requests
        advance(self.sampled, out.token_ids, out.errors, batched=True)
        try:
            return grammars.fill_ahead(self.sampled, stop_ids)
        except Exception:  # the next step's mask fills its rows itself
            log.exception("structured outputs: filling the next step's rows ahead failed")
            return None

    @functools.cached_property
    def row_of(self) -> dict[int, int]:
        """Sequence (by id) -> its index in the step's sampled tokens (read when overlapping)."""
        return {id(seq): i for i, seq in enumerate(self.sampled)}
