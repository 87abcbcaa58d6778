"""A step's tokens into each sequence's text, and the stop rules, one token at a time.

Streaming sequences (``Sequence.lazy_text`` False) are detokenized every step, in one
batched decode, so that stop strings can end them and their deltas can go out; the others
defer their text to one decode when they finish (``flush_text``). A failure is pinned on
the sequence that causes it, never on the batch.
"""

from __future__ import annotations

from typing import Optional

from ingot.engine.sequence import Sequence
from ingot.loading.tokenizer import add_tokens


def detokenize(seqs: list[Sequence], tokens: list[int], errors: list, rows: list[int]) -> None:
    """This step's tokens into each sequence's detokenizer: one batched decode for the
    sequences whose text is read every step; a failure is pinned on the sequence that
    causes it (``errors[rows[k]]``)."""
    for seq, token in zip(seqs, tokens):
        if seq.lazy_text:
            seq.detok.defer([token])
    eager = [k for k, seq in enumerate(seqs) if not seq.lazy_text]
    if not eager:
        return
    try:
        add_tokens([seqs[k].detok for k in eager], [[tokens[k]] for k in eager])
    except Exception:
        for k in eager:  # the batched decode failed: find the culprits one by one
            detok = seqs[k].detok
            saved = (len(detok.ids), detok.prefix_offset, detok.read_offset, detok.text)
            try:
                add_tokens([detok], [[tokens[k]]])
            except Exception as exc:
                del detok.ids[saved[0] :]
                detok.prefix_offset, detok.read_offset, detok.text = saved[1:]
                errors[rows[k]] = f"detokenizing failed: {type(exc).__name__}: {exc}"


def flush_text(finished: list[Sequence], ended_early: bool = False) -> None:
    """The deferred text of finished ``lazy_text`` sequences, in one batched decode; with
    ``ended_early`` (an abort or a failure: no stop string can still form), also the text
    a streaming sequence held back, so its last output has every complete character."""
    lazy = [seq for seq in finished if (seq.lazy_text and not seq.text) or (ended_early and not seq.lazy_text)]
    if not lazy:
        return
    try:
        add_tokens([seq.detok for seq in lazy], [[] for _ in lazy], final=True)
    except Exception:
        for seq in lazy:  # one bad sequence must not cost the others their text
            try:
                add_tokens([seq.detok], [[]], final=True)
            except Exception as exc:
                seq.error = seq.error or f"detokenizing failed: {type(exc).__name__}: {exc}"
    for seq in lazy:
        seq.delta = seq.detok.text[len(seq.text):] if not seq.lazy_text else seq.detok.text
        seq.text = seq.detok.text


def append_token(seq: Sequence, token: int, logprobs, now: float, eos_token_ids: tuple[int, ...],
                 max_model_len: int) -> bool:
    """Record a sampled token (already detokenized into ``seq.detok``) at time ``now`` and
    apply the stop rules; True if the sequence finished (its ``finish_reason`` set: the
    caller hands its blocks back)."""
    p = seq.params
    seq.output_token_ids.append(token)
    seq.token_times.append(now)
    if seq.first_token_time is None:
        seq.first_token_time = now
    if seq.logprobs is not None and logprobs is not None:
        seq.logprobs.append(logprobs)
        seq.cumulative_logprob += logprobs[0][1]
    n_out = len(seq.output_token_ids)
    reason: Optional[str] = None
    stop_reason: Optional[object] = None
    text = seq.detok.text
    if not p.ignore_eos and token in eos_token_ids and n_out > p.min_tokens:
        reason = "stop"
    elif token in p.stop_token_ids and n_out > p.min_tokens:
        reason, stop_reason = "stop", token
    elif p.stop and n_out > p.min_tokens:
        hit = find_stop(text, p.stop, len(seq.text))
        if hit is not None:
            pos, s = hit
            text = text[: pos + len(s)] if p.include_stop_str_in_output else text[:pos]
            reason, stop_reason = "stop", s
    if reason is None and seq.grammar is not None and seq.grammar.terminated:
        reason = "stop"  # the grammar ended (its stop token, where EOS alone would not stop)
    if reason is None and ((p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= max_model_len):
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
    return True


def find_stop(text: str, stops: list[str], already: int) -> Optional[tuple[int, str]]:
    """Earliest stop string in ``text`` that ends past the already-emitted prefix."""
    best: Optional[tuple[int, str]] = None
    for s in stops:
        pos = text.find(s, max(0, already - len(s) + 1))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, s)
    return best
