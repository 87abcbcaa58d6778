"""Structured outputs: grammars compiled by xgrammar off the engine loop, one matcher per sequence.

Where the work runs:

- ``check`` (the caller's thread, ``InputProcessor.process``): xgrammar builds the
  grammar without the tokenizer (microseconds to a few milliseconds, cached by
  constraint), so what it rejects is a ``RequestError`` before anything is queued;
- ``Grammars.hold`` (the engine loop, at admission) starts the compilation against
  the engine's vocabulary in a thread pool (xgrammar releases the GIL); the request
  waits outside the scheduler until it is done, while the others keep decoding.
  Compiled grammars are cached by constraint: a repeated one is not compiled again;
- ``Grammars.token_mask`` (the engine loop, inside a launch: the step's forward is
  already queued on the device) fills each constrained row's allowed-token bitmask
  from its matcher; the sampler applies it on the device.

With a reasoning parser a sequence's constraint starts after its reasoning
(``engine/reasoning.py``: the phase a sequence starts in; ``SequenceGrammar`` moves through
the phases as it takes tokens).

xgrammar (and the transformers tokenizer wrapper it needs) is imported only when the
first request with structured outputs arrives.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Optional, Sequence, TypeVar

import numpy as np
import torch

from ingot.engine.reasoning import ACTIVE, OPENING, REASONING, ReasoningTags
from ingot.loading.tokenizer import Tokenizer
from ingot.runner.sampler import TokenMask
from ingot.sampling_params import StructuredOutputsParams

log = logging.getLogger(__name__)
T = TypeVar("T")

CACHE_SIZE = 256  # compiled grammars kept (each holds per-state token masks: up to a few MB)
BATCH_FILL_ROWS = 16  # from this many constrained rows, xgrammar fills the bitmask in its own threads
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " in front of a message


def xgrammar() -> Any:
    """The xgrammar module, imported on first use (it takes a second or two: transformers)."""
    import xgrammar as xgr

    return xgr


def _message(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _LOG_PREFIX.sub("", text)


def check(spec: StructuredOutputsParams) -> None:
    """Raise ValueError naming the problem if xgrammar cannot build ``spec``'s grammar.

    Without the tokenizer: a structural tag that names tokens is only resolved when it
    is compiled in the engine (a failure then is the request's error output)."""
    _check_key(spec.key)


@functools.lru_cache(maxsize=CACHE_SIZE)
def _check_key(key: tuple[str, str, bool]) -> None:
    kind, text, any_ws = key
    xgr = xgrammar()
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(text, any_whitespace=any_ws)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind in ("grammar", "choice"):
            xgr.Grammar.from_ebnf(_ebnf(kind, text))
        else:
            try:
                xgr.Grammar.from_structural_tag(*_structural_tag_args(xgr, text))
            except Exception as exc:
                if "tokenizer" not in str(exc):  # token names are resolved at compile time
                    raise
    except Exception as exc:
        raise ValueError(f"structured_outputs.{kind}: xgrammar cannot compile it: {_message(exc)}") from None


def _ebnf(kind: str, text: str) -> str:
    """A ``grammar`` is EBNF already; a ``choice`` becomes ``root ::= "a" | "b" ...``."""
    if kind == "grammar":
        return text
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(text))


def _structural_tag_args(xgr: Any, text: str) -> tuple:
    """xgrammar's structural tag, or the legacy ``{"structures": [...], "triggers": [...]}``
    form (as vLLM takes it) as its tags and triggers."""
    tag = json.loads(text)
    if "structures" not in tag:
        return (text,)
    try:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        return items, list(tag["triggers"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"the legacy form needs 'structures' (each with begin, schema, end) and 'triggers': "
                         f"missing {exc}") from None


class SequenceGrammar:
    """One sequence's matcher: it accepts each token the sequence keeps, once (a preempted
    sequence recomputes its tokens without sampling them: nothing reaches the matcher).

    With a reasoning parser (``tags``) the sequence may start in its reasoning (``phase``,
    engine/reasoning.py): those tokens never reach the matcher, which takes the tokens after
    ``</think>``. ``mark`` / ``restore`` walk a verify step's drafts and go back."""

    def __init__(self, matcher: Any, phase: str = ACTIVE, tags: Optional[ReasoningTags] = None) -> None:
        self.matcher = matcher
        self.phase = phase
        self.tags = tags
        self.num_accepted = 0  # tokens taken, the reasoning's included (what min_tokens counts)
        self.num_matched = 0  # of them, those the matcher accepted
        self.error: Optional[str] = None  # once set, the sequence fails at its next read-back

    @property
    def terminated(self) -> bool:
        """The grammar ended: it accepted a stop token after a complete output."""
        return self.matcher.is_terminated()

    def take(self, token: int) -> bool:
        """Advance by ``token``; False (nothing changed) if the grammar refuses it."""
        if self.phase == REASONING:
            if token == self.tags.end:
                self.phase = ACTIVE
        elif self.phase == OPENING and token == self.tags.start:
            self.phase = REASONING
        elif self.matcher.accept_token(token):
            self.phase = ACTIVE
            self.num_matched += 1
        else:
            return False
        self.num_accepted += 1
        return True

    def accept(self, token: int) -> None:
        if self.error is not None:
            return
        try:
            ok = self.take(token)
        except Exception as exc:
            self.error = f"structured outputs: the grammar matcher failed: {_message(exc)}"
            return
        if not ok:
            self.error = f"structured outputs: token {token} is not allowed by the grammar"

    def mark(self) -> tuple[str, int, int]:
        return self.phase, self.num_accepted, self.num_matched

    def restore(self, mark: tuple[str, int, int]) -> None:
        """Back to ``mark`` (the tokens taken since, rolled back)."""
        if self.num_matched > mark[2]:
            self.matcher.rollback(self.num_matched - mark[2])
        self.phase, self.num_accepted, self.num_matched = mark

    @property
    def live(self) -> bool:
        """Has it a next token to constrain (neither failed nor ended)?"""
        return self.error is None and not self.matcher.is_terminated()

    def fill(self, bitmask: Any, row: int) -> bool:
        """Row ``row`` of ``bitmask``: the tokens allowed next; False (and ``error``) if it failed."""
        if self.phase != REASONING:
            try:
                self.matcher.fill_next_token_bitmask(bitmask, row)
            except Exception as exc:
                self.error = f"structured outputs: the grammar matcher failed: {_message(exc)}"
                return False
        self.amend(bitmask, row)
        return True

    def amend(self, bitmask: torch.Tensor, row: int) -> None:
        """Row ``row`` as the reasoning makes it, once the matcher has filled it (outside the
        reasoning): in the reasoning every token; where the reply may open its reasoning,
        ``<think>`` besides the grammar's tokens."""
        if self.phase == REASONING:
            bitmask[row] = -1
        elif self.phase == OPENING:
            t = self.tags.start
            bitmask.numpy().view(np.uint32)[row, t >> 5] |= np.uint32(1 << (t & 31))


def _hold_stop_tokens(line: np.ndarray, stop_ids: Sequence[int]) -> None:
    """Below ``min_tokens``: take the stop tokens out of a row of the bitmask (its uint32
    words), unless nothing else is allowed (a complete output may only stop)."""
    kept = line.copy()
    for t in stop_ids:
        if 0 <= t < 32 * line.shape[0]:
            line[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
    if not line.any():
        line[:] = kept


class Grammars:
    """The engine's structured-output side: compilation (cached, in a thread pool), the
    requests waiting for theirs, and per step the constrained rows' bitmask."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int], workers: int = 2,
                 pin_memory: bool = False, reasoning: Optional[ReasoningTags] = None) -> None:
        self.tokenizer = tokenizer
        self.reasoning = reasoning  # a reasoning parser's tags: the constraint starts after the reasoning
        self.vocab_size = vocab_size  # the logits' width: the tokenizer's ids, padded to the model's
        self.stop_token_ids = tuple(stop_token_ids)
        self.workers = workers
        # CUDA: each step's bitmask in pinned memory (PyTorch's pinned cache reuses a block only
        # once its copy to the device is done), so the copy never waits for the forward
        self.pin_memory = pin_memory
        self._batch_fill: Any = None
        self.compiles = 0  # grammars compiled (a cached constraint is not compiled again)
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()
        self._held: dict[str, tuple[Future, Any]] = {}  # request id -> (its compilation, its RequestState)
        self._pool: Optional[ThreadPoolExecutor] = None
        self._compiler: Any = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ compilation
    def hold(self, request_id: str, spec: StructuredOutputsParams, state: Any) -> None:
        """Start compiling ``spec`` (unless it is cached); the request (``state``: its
        sequences in ``state.seqs``) waits here until ``admit`` finds it compiled."""
        self._held[request_id] = (self._compile(spec.key), state)

    def release(self, request_id: str) -> None:
        """Forget a held request (aborted)."""
        self._held.pop(request_id, None)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def admit(self, add: Callable[[Any], None], finish: Callable[[Any, str, str], T]) -> list[T]:
        """Each held request whose grammar is compiled: a matcher for each of its sequences,
        then each sequence to ``add`` (the scheduler); a grammar that could not be compiled
        fails its request (``finish(state, "error", message)``: its output)."""
        outputs = []
        for rid, (future, state) in list(self._held.items()):
            if not future.done():
                continue
            del self._held[rid]
            exc = future.exception()
            if exc is not None:
                outputs.append(finish(state, "error", f"structured outputs: xgrammar cannot compile the grammar: {_message(exc)}"))
                continue
            xgr = xgrammar()
            tags = self.reasoning
            for seq in state.seqs:
                phase = tags.first_phase(seq.prompt_token_ids) if tags is not None else ACTIVE
                seq.grammar = SequenceGrammar(xgr.GrammarMatcher(future.result()), phase, tags)
                add(seq)
        return outputs

    def wait(self, timeout: float) -> None:
        """Block until a held grammar is compiled, at most ``timeout`` seconds (nothing else to do)."""
        if self._held:
            wait([f for f, _ in self._held.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    def _compile(self, key: tuple[str, str, bool]) -> Future:
        future = self._compiled.get(key)
        if future is not None:
            self._compiled.move_to_end(key)
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="ingot-grammar")
        self.compiles += 1
        future = self._pool.submit(self._compile_now, key)
        self._compiled[key] = future
        while len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        return future

    def _compile_now(self, key: tuple[str, str, bool]) -> Any:
        compiler = self._get_compiler()
        kind, text, any_ws = key
        if kind == "json":
            return compiler.compile_json_schema(text, any_whitespace=any_ws)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind in ("grammar", "choice"):
            return compiler.compile_grammar(_ebnf(kind, text))
        return compiler.compile_structural_tag(*_structural_tag_args(xgrammar(), text))

    def _get_compiler(self) -> Any:
        with self._lock:  # the first compilation builds it, in a pool thread
            if self._compiler is None:
                xgr = xgrammar()
                tags = () if self.reasoning is None else (self.reasoning.start, self.reasoning.end)
                info = tokenizer_info(xgr, self.tokenizer, self.vocab_size, self.stop_token_ids, blank=tags)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.workers, cache_enabled=False)
            return self._compiler

    # ------------------------------------------------------------------ steps
    def token_mask(self, batch_seqs: Sequence[Any], stop_ids: Sequence[int], wait_previous: Optional[Callable[[], None]],
                   rows: list[int], drafts: Optional[list[list[int]]] = None) -> Optional[TokenMask]:
        """The allowed tokens of the constrained rows among ``rows`` (the batch rows that
        sample, in logits order). Called by the runner once the step's forward is queued. A
        constrained row whose last token is still on the device (overlap scheduling) needs
        its matcher to have accepted it: ``wait_previous`` reads the previous step back and
        advances its matchers. ``drafts``: a verify step's drafts per batch row; the mask then
        has a row per position (``_draft_mask``). Never raises: a failure fails the rows'
        requests at read-back."""
        seqs = [batch_seqs[r] for r in rows]
        constrained = [j for j, seq in enumerate(seqs) if seq.grammar is not None]
        try:
            if wait_previous is not None and any(seqs[j].num_pending for j in constrained):
                wait_previous()
            if not constrained:
                return None
            if drafts is not None:
                return self._draft_mask(seqs, [drafts[r] for r in rows], constrained, stop_ids)
            bitmask = torch.empty((len(constrained), (self.vocab_size + 31) // 32), dtype=torch.int32,
                                  pin_memory=self.pin_memory)
            live = []  # (bitmask row, grammar); the others allow every token (their token is dropped)
            for i, j in enumerate(constrained):
                if seqs[j].grammar.live:
                    live.append((i, seqs[j].grammar))
                else:
                    bitmask[i] = -1
            self._fill(bitmask, live)
            words = bitmask.numpy().view(np.uint32)
            for i, j in enumerate(constrained):
                grammar, params = seqs[j].grammar, seqs[j].params
                if grammar.error is not None:
                    bitmask[i] = -1
                elif grammar.num_accepted < params.min_tokens:
                    _hold_stop_tokens(words[i], (*stop_ids, *params.stop_token_ids))
            return TokenMask(constrained, bitmask)
        except Exception as exc:
            log.exception("structured outputs: the token mask failed")
            for j in constrained:
                seqs[j].grammar.error = f"structured outputs: {type(exc).__name__}: {exc}"
            return None

    def _draft_mask(self, seqs: list[Any], drafts: list[list[int]], constrained: list[int],
                    stop_ids: Sequence[int]) -> TokenMask:
        """A verify step's mask: each constrained row's allowed tokens at each of its positions
        (rows of the logits: a row's last token, then its drafts), its matcher walked through
        the drafts and rolled back (a draft ``</think>`` ends the reasoning for the positions
        after it). Past a draft the grammar refuses (the target never keeps it: its own
        position's mask excludes it) or past the grammar's end, every token is allowed: no
        kept token is sampled there."""
        starts = [0]
        for d in drafts:
            starts.append(starts[-1] + len(d) + 1)
        rows = [starts[j] + i for j in constrained for i in range(len(drafts[j]) + 1)]
        bitmask = torch.full((len(rows), (self.vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=self.pin_memory)
        words = bitmask.numpy().view(np.uint32)
        at = 0
        for j in constrained:
            grammar, params = seqs[j].grammar, seqs[j].params
            mark = grammar.mark()
            try:
                for i in range(len(drafts[j]) + 1):
                    if not grammar.live or not grammar.fill(bitmask, at + i):
                        break
                    if grammar.num_accepted < params.min_tokens:
                        _hold_stop_tokens(words[at + i], (*stop_ids, *params.stop_token_ids))
                    if i == len(drafts[j]) or not grammar.take(drafts[j][i]):
                        break
            finally:
                grammar.restore(mark)
            if grammar.error is not None:
                bitmask[at : at + len(drafts[j]) + 1] = -1
            at += len(drafts[j]) + 1
        return TokenMask(rows, bitmask)

    def _fill(self, bitmask: torch.Tensor, live: list[tuple[int, SequenceGrammar]]) -> None:
        """Fill the live rows: many at once through xgrammar's threaded batch fill (the rows
        whose matcher decides: not in their reasoning); a failure there (or a few rows) row
        by row, so that a failing matcher fails alone."""
        matched = [(i, g) for i, g in live if g.phase != REASONING]
        if len(matched) >= BATCH_FILL_ROWS:
            if self._batch_fill is None:
                self._batch_fill = xgrammar().BatchGrammarMatcher(max_threads=min(8, os.cpu_count() or 1))
            try:
                self._batch_fill.batch_fill_next_token_bitmask([g.matcher for _, g in matched], bitmask, [i for i, _ in matched])
                for i, g in live:
                    g.amend(bitmask, i)
                return
            except Exception:
                pass
        for i, grammar in live:
            grammar.fill(bitmask, i)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def advance(seqs: Sequence[Any], tokens: Sequence[int], errors: Optional[Sequence[Optional[str]]]) -> None:
    """Each constrained, unfinished sequence's matcher accepts the token it sampled (rows
    whose sampling failed are skipped; a rejected token sets ``grammar.error``)."""
    for k, seq in enumerate(seqs):
        grammar = seq.grammar
        if grammar is not None and not seq.finished and (errors is None or errors[k] is None):
            grammar.accept(tokens[k])


def tokenizer_info(xgr: Any, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                   blank: Sequence[int] = ()) -> Any:
    """xgrammar's view of ingot's tokenizer, ``vocab_size`` wide (ids past the tokenizer's are
    never allowed). Special tokens and ``blank`` (a reasoning parser's tags) are blanked, so no
    grammar matches them as text (a ``<|im_start|>`` inside a JSON string); the stop tokens end
    a complete output."""
    from transformers import PreTrainedTokenizerFast  # xgrammar reads the vocabulary's encoding from it

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.tok)
    stop = list(stop_token_ids) or None
    meta = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop).dump_metadata()
    vocab = [""] * vocab_size
    for token, i in tokenizer.tok.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            vocab[i] = token
    for i, added in tokenizer.tok.get_added_tokens_decoder().items():
        if added.special and i < vocab_size:
            vocab[i] = ""
    for i in blank:
        if i < vocab_size:
            vocab[i] = ""
    return xgr.TokenizerInfo.from_vocab_and_metadata(vocab, meta)
