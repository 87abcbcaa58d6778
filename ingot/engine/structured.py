"""Structured outputs: grammars compiled by xgrammar off the engine loop, one matcher per sequence.

Where the work runs:

- ``check`` (the caller's thread, ``InputProcessor.process``): xgrammar builds the
  grammar without the tokenizer (microseconds to a few milliseconds, cached by
  constraint), so what it rejects is a ``RequestError`` before anything is queued;
- ``Grammars.hold`` (the engine loop, at admission) starts the compilation against
  the engine's vocabulary in a thread pool (xgrammar releases the GIL); the request
  waits outside the scheduler until it is done, while the others keep decoding.
  Compiled grammars are cached by constraint: a repeated one is not compiled again;
- each step's side (the matchers, their tokens, the bitmask the sampler applies):
  ``engine/grammar_step.py``.

With a reasoning parser a sequence's constraint starts after its reasoning
(``engine/reasoning.py``: the phase a sequence starts in; ``SequenceGrammar`` moves through
the phases as it takes tokens).

xgrammar (and the transformers tokenizer wrapper it needs) is imported only when the
first request with structured outputs arrives.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Optional, Sequence, TypeVar

from ingot.engine.grammar_step import (BATCH_FILL_ROWS, NextMasks, SequenceGrammar, StepMasks, advance, xgrammar,
                                       xgrammar_message)
from ingot.engine.reasoning import ACTIVE, ReasoningTags
from ingot.loading.tokenizer import Tokenizer
from ingot.sampling_params import StructuredOutputsParams

__all__ = ["BATCH_FILL_ROWS", "Grammars", "NextMasks", "SequenceGrammar", "advance", "check", "tokenizer_info",
           "xgrammar"]

T = TypeVar("T")

CACHE_SIZE = 256  # compiled grammars kept (each holds per-state token masks: up to a few MB)


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
        raise ValueError(f"structured_outputs.{kind}: xgrammar cannot compile it: {xgrammar_message(exc)}") from None


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


class Grammars(StepMasks):
    """The engine's structured-output side: compilation (cached, in a thread pool), the
    requests waiting for theirs, and per step the constrained rows' bitmask (``StepMasks``)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int], workers: int = 2,
                 pin_memory: bool = False, reasoning: Optional[ReasoningTags] = None, ahead: bool = False) -> None:
        super().__init__(vocab_size, pin_memory, ahead)
        self.tokenizer = tokenizer
        self.reasoning = reasoning  # a reasoning parser's tags: the constraint starts after the reasoning
        self.stop_token_ids = tuple(stop_token_ids)
        self.workers = workers
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
                outputs.append(finish(state, "error", f"structured outputs: xgrammar cannot compile the grammar: {xgrammar_message(exc)}"))
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

    def close(self) -> None:
        super().close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


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
