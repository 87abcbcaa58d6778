"""Response bodies and stream chunks in OpenAI's shapes, built from RequestOutputs.

Plain dicts (serialised once by the caller): completions with the legacy
logprobs format (``tokens / token_logprobs / top_logprobs / text_offset``),
chat completions with ``logprobs.content[]``, usage with cached prompt tokens.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional, Protocol, Sequence

from ingot.outputs import CompletionOutput, Logprob, RequestOutput

class Outputs(Protocol):
    """A request's engine outputs in flight (``app._Flight``)."""

    def outputs(self) -> AsyncIterator[RequestOutput]: ...


OPENAI_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


def usage(outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return usage_of(prompt, completion, cached)


def usage_of(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def prompt_logprobs(positions: Optional[Sequence[Optional[dict[int, Logprob]]]]) -> Optional[list[Optional[dict]]]:
    """vLLM's ``prompt_logprobs``: per prompt token (the first has none) its entries keyed
    by token id, each ``{logprob, rank, decoded_token}``."""
    if positions is None:
        return None
    return [None if pos is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                      for t, lp in pos.items()}
            for pos in positions]


def _sampled(position: dict[int, Logprob], token: int) -> Logprob:
    return position.get(token) or Logprob(float("nan"))


def _top(position: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    """The top-n entries of one position, best first (the sampled token is ranked too)."""
    ranked = sorted(((t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= n), key=lambda e: e[1].rank)
    return ranked[:n]


class LegacyLogprobs:
    """The completions API's logprobs of one choice, grown chunk by chunk (``text_offset``
    counts characters from the start of the choice's text, echoed prompt included)."""

    def __init__(self, top_n: int, tokenizer: Any, offset: int = 0) -> None:
        self.top_n = top_n
        self.tokenizer = tokenizer
        self.offset = offset

    def block(self, token_ids: Sequence[int], positions: Sequence[Optional[dict[int, Logprob]]]) -> dict[str, Any]:
        tokens, lps, tops, offsets = [], [], [], []
        for token, pos in zip(token_ids, positions):
            if pos is None:  # the first prompt token has no logprob
                text, lp, top = self.tokenizer.decode([token]), None, None
            else:
                entry = _sampled(pos, token)
                text = entry.decoded_token or ""
                lp = entry.logprob
                top = {(e.decoded_token or ""): e.logprob for _, e in _top(pos, self.top_n)} if self.top_n else None
            tokens.append(text)
            lps.append(lp)
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def merge(a: Optional[dict[str, Any]], b: dict[str, Any]) -> dict[str, Any]:
        if a is None:
            return b
        return {k: a[k] + b[k] for k in b}


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[dict[int, Logprob]], top_n: int) -> dict[str, Any]:
    """``{"content": [{token, logprob, bytes, top_logprobs}]}`` for the given tokens."""

    def item(lp: Logprob) -> dict[str, Any]:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token, pos in zip(token_ids, positions):
        entry = item(_sampled(pos, token))
        entry["top_logprobs"] = [item(lp) for _, lp in _top(pos, top_n)]
        content.append(entry)
    return {"content": content}


def new_logprobs(c: CompletionOutput) -> list[dict[int, Logprob]]:
    """The logprob entries of the tokens a completion gained in its last output."""
    if c.logprobs is None or not c.delta_token_ids:
        return []
    return c.logprobs[len(c.logprobs) - len(c.delta_token_ids):]


def finish_reason(c: CompletionOutput) -> Optional[str]:
    return None if c.finish_reason is None else OPENAI_FINISH.get(c.finish_reason, c.finish_reason)
