"""The serving benchmark's workloads: what ``ingot bench serve`` sends.

The workload is ``num_requests`` requests whose prompt and output lengths are
drawn uniformly from inclusive ranges, with random prompt token ids, all from
one seed. Requests arrive all at once (``request_rate=inf``) or as a Poisson
process of the given rate (requests/s).

Prefix sharing: with ``shared_prefix_len`` N every prompt starts with the same
N random tokens (a system prompt), then its own part drawn from ``input_len``.
``kind="multi-turn"``: each of the ``num_requests`` is a conversation of
``turns`` turns; a turn's prompt is the conversation so far (the previous
prompt, the tokens the model answered, a new user message of ``input_len``
tokens), sent as soon as the previous turn has finished.
``kind="copy"``: prompts of ``input_len`` tokens that ask the model to repeat text they
hold (standard-library code and docstrings, ``ingot/bench/copy_workload.py``), where
n-gram speculative decoding finds its drafts.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from ingot.bench.copy_workload import copy_prompts

# Prompt token ids are drawn from [SPECIAL_MARGIN, vocab_size - SPECIAL_MARGIN):
# special tokens (bos, eos, pad, chat markers) usually sit at either end of the vocab.
SPECIAL_MARGIN = 10
KINDS = ("random", "multi-turn", "copy")


class WorkloadError(ValueError):
    """The workload is invalid or does not fit the model (the message says which bound)."""


@dataclass(frozen=True)
class Workload:
    """What to send: counts, inclusive length ranges, arrival rate and seed."""

    num_requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    request_rate: float = math.inf  # requests/s; inf = all at once
    seed: int = 0
    shared_prefix_len: int = 0  # tokens every prompt starts with
    kind: str = "random"  # or "multi-turn": num_requests conversations; or "copy"
    turns: tuple[int, int] = (1, 1)  # turns per conversation (multi-turn)

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise WorkloadError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.shared_prefix_len < 0:
            raise WorkloadError(f"shared_prefix_len must be >= 0, got {self.shared_prefix_len}")
        if self.kind not in KINDS:
            raise WorkloadError(f"workload must be one of {KINDS}, got {self.kind!r}")
        if self.kind != "multi-turn" and self.turns != (1, 1):
            raise WorkloadError("turns apply to the multi-turn workload only")
        if self.kind == "copy" and self.shared_prefix_len:
            raise WorkloadError("a shared prefix applies to the random and multi-turn workloads, not copy")
        for name in ("input_len", "output_len", "turns"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise WorkloadError(f"{name} range must satisfy 1 <= low <= high, got {lo}-{hi}")
        if not self.request_rate > 0:  # also rejects NaN
            raise WorkloadError(f"request_rate must be > 0 (or inf), got {self.request_rate}")

    def to_json(self) -> dict:
        d = asdict(self)
        d["input_len"], d["output_len"], d["turns"] = list(self.input_len), list(self.output_len), list(self.turns)
        d["request_rate"] = format_rate(self.request_rate)
        return d


@dataclass(frozen=True)
class Turn:
    """A later turn of a conversation: the user's new message and the reply length."""

    user_token_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    output_len: int
    arrival_s: float  # seconds after the start of the run
    next_turns: tuple[Turn, ...] = ()  # sent one by one, each once the previous turn has finished

    @property
    def max_len(self) -> int:
        """Tokens the last turn can reach: every prompt, reply and later message."""
        return len(self.prompt_token_ids) + self.output_len + sum(len(t.user_token_ids) + t.output_len for t in self.next_turns)

    def follow_up(self, output_token_ids: list[int], arrival_s: float) -> "Request":
        """The next turn: this prompt, the reply the model gave, the next user message."""
        turn, *rest = self.next_turns
        return Request(self.prompt_token_ids + list(output_token_ids) + turn.user_token_ids, turn.output_len, arrival_s, tuple(rest))


def parse_range(text: str) -> tuple[int, int]:
    """``"64-1024"`` -> (64, 1024); ``"32"`` -> (32, 32). Bounds are inclusive."""
    parts = text.strip().split("-")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"expected a length or a range LOW-HIGH, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"range must satisfy 1 <= LOW <= HIGH, got {text!r}")
    return lo, hi


def parse_rate(text: str) -> float:
    """Requests per second; ``inf`` (default) sends every request at once."""
    rate = float(text)
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 or inf, got {text!r}")
    return rate


def format_rate(rate: float) -> object:
    return "inf" if math.isinf(rate) else rate


def make_requests(workload: Workload, vocab_size: int, tokenizer: Any = None) -> list[Request]:
    """The workload's requests, in arrival order; the same seed gives the same requests.

    Lengths and prompts come from one random stream, the shared prefix and arrival
    gaps from others, so changing the rate or the prefix keeps the rest. The first
    request arrives at 0. Multi-turn: one request per conversation, its later turns
    in ``next_turns``. Copy: prompts of text tokenized by ``tokenizer`` (required).
    """
    if workload.kind == "copy":
        return _copy_requests(workload, tokenizer)
    lo_id, hi_id = SPECIAL_MARGIN, vocab_size - SPECIAL_MARGIN
    if hi_id <= lo_id:
        raise WorkloadError(f"vocab of {vocab_size} tokens is too small for random prompts")
    rng = random.Random(workload.seed)
    prefix_rng = random.Random(f"prefix-{workload.seed}")
    prefix = [prefix_rng.randrange(lo_id, hi_id) for _ in range(workload.shared_prefix_len)]
    out: list[Request] = []
    for t in arrival_times(workload):
        turns = []
        # a single-turn workload draws no turn count: its requests (lengths, ids) match those of
        # the same seed drawn without any turns field, as in earlier result files
        for _ in range(rng.randint(*workload.turns) if workload.kind == "multi-turn" else 1):
            in_len = rng.randint(*workload.input_len)
            out_len = rng.randint(*workload.output_len)
            turns.append(Turn([rng.randrange(lo_id, hi_id) for _ in range(in_len)], out_len))
        first, *later = turns
        out.append(Request(prefix + first.user_token_ids, first.output_len, t, tuple(later)))
    return out


def arrival_times(workload: Workload) -> list[float]:
    """Each request's arrival (seconds after the start): 0 for all at once, else Poisson
    arrivals of ``request_rate`` from their own seeded stream, the first at 0."""
    rng = random.Random(f"arrivals-{workload.seed}")
    out, t = [], 0.0
    for i in range(workload.num_requests):
        if i > 0 and not math.isinf(workload.request_rate):
            t += rng.expovariate(workload.request_rate)
        out.append(t)
    return out


def _copy_requests(workload: Workload, tokenizer: Any) -> list[Request]:
    """The copy workload: lengths from the seed's stream, prompts from ``copy_prompts``."""
    if tokenizer is None:
        raise WorkloadError("the copy workload needs the model's tokenizer")
    rng = random.Random(workload.seed)
    lengths = [(rng.randint(*workload.input_len), rng.randint(*workload.output_len)) for _ in range(workload.num_requests)]
    try:
        prompts = copy_prompts(tokenizer, [n for n, _ in lengths], workload.seed)
    except ValueError as exc:
        raise WorkloadError(str(exc)) from None
    return [Request(p.token_ids, out_len, t) for p, (_, out_len), t in zip(prompts, lengths, arrival_times(workload))]


def check_fits(requests: Sequence[Request], max_model_len: int) -> None:
    """Every request (every turn of a conversation) must fit its prompt and output in the context."""
    worst = max(r.max_len for r in requests)
    if worst > max_model_len:
        raise WorkloadError(
            f"a request needs {worst} tokens (prompt + output) but max_model_len is {max_model_len}; "
            "lower --input-len/--output-len or raise --max-model-len"
        )
