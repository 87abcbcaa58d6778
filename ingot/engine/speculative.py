"""Speculative decoding, the engine's side: n-gram proposals (or a draft model's, made by the
runner: ``runner/draft_runner.py``), which sequences speculate, and reading a verify step back
(the verification itself: ``runner/spec_verify.py``).

Each step, before scheduling, ``Speculator.propose`` gives every decoding sequence that may
speculate up to ``num_speculative_tokens`` drafted tokens (``Sequence.draft_token_ids``);
the scheduler grows its blocks for them (or drops them rather than preempt anyone) and
the step becomes a verify step (``ScheduledBatch.draft_tokens``): a decode step with a row
per token, the sequence's last token and each draft, replayed through the verify CUDA
graphs (a sequence without drafts is one row, as in a decode step). A verify step
is read back at once (no overlap: the next proposals need its tokens). Reading it back
rolls each sequence's computed tokens back to what it kept, hands back the blocks only
rejected drafts used, and applies the emitted tokens one position at a time through the
engine's stop rules, so a stop string, stop token or ``max_tokens`` inside an accepted run
ends the sequence exactly where plain decoding would.

Not speculating: above ``disable_by_batch_size`` running sequences (a big batch is
compute-bound), for sequences with penalties or an active ``min_tokens`` (their
distributions depend on every earlier token), per sequence after low acceptance or
lookups that found nothing (``SpecState.backoff``), and, with the step in flight not yet
read back, where the tokens before its pending one never occurred earlier: no lookup could
find a draft, so the step stays overlapped (``NgramIndex.may_follow``).
With a draft model, the draft sits out every step after which no sequence may speculate
(``DraftModelSpeculator.plan``): above ``disable_by_batch_size`` it costs nothing; each
sequence's draft K/V then trails its own (``Sequence.draft_kv_len``) and is caught up when it
speculates again.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol

from ingot.config import SpeculativeConfig
from ingot.engine.ngram import BACKOFF_MAX, DRAFT_BACKOFF_MAX, NgramIndex, SpecState
from ingot.engine.scheduler import Scheduler
from ingot.engine.sequence import Sequence, Status
from ingot.outputs import RequestOutput
from ingot.runner.batch import ScheduledBatch


class EngineSide(Protocol):
    """What reading a verify step back uses of the engine (``Engine``)."""

    scheduler: Scheduler
    generation_tokens: int

    def _apply(self, touched: list[Sequence], tokens: list[int], lps: list, errors: list) -> dict[str, Any]: ...

    def _outputs(self, states: Iterable[Any]) -> list[RequestOutput]: ...

    def _fail_batch(self, batch: ScheduledBatch, message: str) -> list[RequestOutput]: ...


def _allowed(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty


class Speculator:
    """The engine's proposer and the counters of what speculation drafted and kept."""

    backoff_max = BACKOFF_MAX  # the longest pause after poor drafts (ngram.py)

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def _state(self, seq: Sequence) -> SpecState:
        st = seq.spec
        if st is None:
            c = self.config
            st = seq.spec = SpecState(_allowed(seq), c.prompt_lookup_min, c.prompt_lookup_max, self.backoff_max)
        return st

    def _budget(self, seq: Sequence) -> int:
        """Drafts ``seq`` may take now: 0 unless it may speculate; at most one fewer than the
        tokens it may still emit (a verify step emits up to drafts + 1)."""
        st = self._state(seq)
        p = seq.params
        n_out = len(seq.output_token_ids)
        if not st.allowed or st.skip or n_out < p.min_tokens:
            return 0
        k = min(self.config.num_speculative_tokens, self.max_model_len - seq.num_tokens - 1)
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - n_out - 1)
        return max(k, 0)

    def wanted(self, running: list[Sequence]) -> bool:
        """Will some running sequence propose this step? (Then the step in flight is read
        back first: proposals need the tokens it sampled.)"""
        if len(running) > self.config.disable_by_batch_size:
            return False
        return any(self._budget(seq) and self._may_draft(seq) for seq in running)

    def _may_draft(self, seq: Sequence) -> bool:
        """Can ``seq``'s lookup find a draft once its pending token is read back? Not where
        the tokens before that one never occurred earlier (``NgramIndex.may_follow``): its step
        then stays overlapped, a plain step, and its backoff does not count it."""
        if not seq.num_pending:
            return True
        return _indexed(self._state(seq), seq, seq.num_tokens - seq.num_pending).may_follow()

    def propose(self, running: list[Sequence], active: bool) -> None:
        """Set every running sequence's ``draft_token_ids`` for the next schedule (empty
        unless ``active`` and it may speculate); count down the backoffs."""
        for seq in running:
            st = self._state(seq)
            if st.skip:
                st.skip -= 1
                seq.draft_token_ids = []
                continue
            k = self._budget(seq) if active else 0
            if not k or seq.num_pending or seq.status is not Status.RUNNING \
                    or seq.num_computed_tokens != seq.num_tokens - 1:  # preempted, or in prefill
                seq.draft_token_ids = []
                continue
            seq.draft_token_ids = self._draft(seq, st, k)
            if not seq.draft_token_ids:
                st.record(0, 0)

    def _draft(self, seq: Sequence, st: SpecState, k: int) -> list[int]:
        """Up to ``k`` drafted tokens for ``seq``: the n-gram lookup's."""
        return _indexed(st, seq, seq.num_tokens).propose(k)

    def plan(self, batch: ScheduledBatch, running: list[Sequence]) -> None:
        """Before ``batch`` is launched (``running``: the scheduler's sequences now): does a
        draft model run on it? (N-gram drafts: there is none.)"""

    def launched(self, batch: ScheduledBatch) -> None:
        """Once ``batch`` is queued, its rows' computed tokens counted."""

    def counters(self) -> dict[str, int]:
        """The engine-wide counters, as ``EngineStats`` fields."""
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens}

    def finish(self, engine: EngineSide, flight: Any) -> list[RequestOutput]:
        """Read a verify step back: roll back what rejected drafts computed, then the emitted
        tokens through the engine's stop rules, one position at a time."""
        batch, seqs = flight.batch, flight.sampled
        drafts = batch.draft_tokens
        assert drafts is not None and len(seqs) == len(batch.seqs)
        try:
            out = flight.step.collect()
        except Exception as exc:
            return engine._fail_batch(batch, f"the model step failed: {type(exc).__name__}: {exc}")
        blocks = engine.scheduler.blocks
        for seq, draft, accepted in zip(seqs, drafts, out.num_accepted):
            if seq.status is Status.RUNNING:
                seq.num_computed_tokens -= len(draft) - accepted
            if draft:
                self._state(seq).record(len(draft), accepted)
                self.num_drafts += 1
                self.num_draft_tokens += len(draft)
                self.num_accepted_tokens += accepted
            self._verified(seq, draft, accepted)
        errors = list(out.errors or [None] * len(seqs))
        flight.advanced = True  # (each matcher accepts its row's tokens position by position, below)
        changed: dict[str, Any] = {}
        for j in range(max(len(t) for t in out.tokens)):
            rows = [k for k, t in enumerate(out.tokens) if j < len(t) and (j == 0 or errors[k] is None)]
            for k in rows:  # the grammar first, so that its end is seen at the token that ends it
                grammar = seqs[k].grammar
                if grammar is not None and not seqs[k].finished and errors[k] is None and grammar.live:
                    grammar.accept(out.tokens[k][j])
                    errors[k] = grammar.error
            lps = [out.logprobs[k][j] if out.logprobs[k] is not None else None for k in rows]
            changed.update(engine._apply([seqs[k] for k in rows], [out.tokens[k][j] for k in rows], lps,
                                         [errors[k] for k in rows]))
        engine.generation_tokens += sum(len(t) for t in out.tokens)
        for seq in seqs:
            if seq.status is Status.RUNNING:
                blocks.trim(seq, seq.num_tokens)
        engine.scheduler.on_step_done(batch, [seq.num_computed_tokens for seq in seqs])
        return engine._outputs(changed.values())

    def _verified(self, seq: Sequence, draft: list[int], accepted: int) -> None:
        """After ``seq``'s verify step, its computed tokens rolled back (n-gram drafts: nothing to do)."""


def _indexed(st: SpecState, seq: Sequence, upto: int) -> NgramIndex:
    """``seq``'s n-gram index, holding its first ``upto`` tokens (those known on the host)."""
    index = st.index
    if index.num_tokens < upto:
        index.extend(seq.tokens(index.num_tokens, upto))
    return index


# What a draft model's speculator proposes before scheduling: how many drafts a sequence may
# take (the scheduler grows its blocks for them), replaced by the draft model's tokens when
# the verify step is launched (``runner/draft_runner.py``).
DRAFT_PLACEHOLDER = -1


class DraftModelSpeculator(Speculator):
    """Speculation with a draft model (``speculative_config.model``): every sequence that may
    speculate takes its whole budget of drafts, which the runner's draft model proposes at
    launch. The engine decides which steps the draft runs on (``plan``) and keeps each
    sequence's draft frontier (``Sequence.draft_kv_len``: its leading tokens whose draft K/V is
    written); the runner catches a trailing frontier up before the draft reads past it."""

    backoff_max = DRAFT_BACKOFF_MAX  # an attempt costs several steps: pause longer (ngram.py)

    def _draft(self, seq: Sequence, st: SpecState, k: int) -> list[int]:
        return [DRAFT_PLACEHOLDER] * k

    def _may_draft(self, seq: Sequence) -> bool:
        return True  # the draft model proposes whatever the token

    def plan(self, batch: ScheduledBatch, running: list[Sequence]) -> None:
        """The draft runs on a plain step (``batch.draft_follows``) when the next step may
        speculate: ``wanted`` of the running sequences as this step's proposals left them (at
        most ``disable_by_batch_size`` of them, one allowed and not backed off). Otherwise it
        sits out, and a sequence that speculates later first has its missing draft K/V caught
        up (``DraftedModelRunner._catch_up``: eager prefill chunks of the draft, once per
        return to speculation). Prefill steps follow the same rule: a prompt's draft K/V costs
        the same computed now or caught up later, and later only sequences that speculate pay
        it. (A verify step's draft round always runs.)"""
        batch.draft_follows = batch.draft_tokens is None and self.wanted(running)

    def launched(self, batch: ScheduledBatch) -> None:
        """Each row's draft frontier once ``batch`` is queued: a step the draft runs on brings
        every row's draft K/V up to its computed tokens, but for the last draft of a verify
        row (the round feeds each row's last token, then every draft but the last); a step it
        sits out leaves the frontiers where they were."""
        if batch.draft_tokens is not None:
            for seq, draft in zip(batch.seqs, batch.draft_tokens):
                if seq.status is Status.RUNNING:
                    seq.draft_kv_len = seq.num_computed_tokens - (1 if draft else 0)
        elif batch.draft_follows:
            for seq in batch.seqs:
                if seq.status is Status.RUNNING:
                    seq.draft_kv_len = seq.num_computed_tokens

    def _verified(self, seq: Sequence, draft: list[int], accepted: int) -> None:
        """Rejected drafts' draft K/V lies past the kept tokens; a round that kept every draft
        leaves the last one's missing (it was proposed, never fed): fed with the next token."""
        seq.draft_kv_len = min(seq.draft_kv_len, seq.num_computed_tokens)


class EagleSpeculator(DraftModelSpeculator):
    """Speculation with an EAGLE head (``runner/eagle_runner.py``): as with a draft model, but the
    head's K/V of the drafts it fed itself was computed from its own hidden states, not the
    target's; after a verify step only the sequence's last token counts as seen, so the next
    round feeds the kept drafts again (with the target's hidden states)."""

    def launched(self, batch: ScheduledBatch) -> None:
        if batch.draft_tokens is None:
            super().launched(batch)
            return
        for seq, draft in zip(batch.seqs, batch.draft_tokens):
            if seq.status is Status.RUNNING:
                seq.draft_kv_len = seq.num_computed_tokens - len(draft)


def make_speculator(config: SpeculativeConfig, max_model_len: int) -> Speculator:
    """The engine's speculator for ``config``'s method."""
    if config.uses_eagle:
        return EagleSpeculator(config, max_model_len)
    return (DraftModelSpeculator if config.uses_draft_model else Speculator)(config, max_model_len)


def spec_metrics(seqs: list[Sequence]) -> dict[str, int]:
    """A request's speculation counts over its samples, as ``RequestMetrics`` fields."""
    states = [s.spec for s in seqs if s.spec is not None]
    return {"spec_num_drafts": sum(st.num_drafts for st in states),
            "spec_num_draft_tokens": sum(st.num_draft_tokens for st in states),
            "spec_num_accepted_tokens": sum(st.num_accepted_tokens for st in states)}
