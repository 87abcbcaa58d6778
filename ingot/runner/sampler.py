"""Batched token sampling on the logits' device.

Order of operations per row (all batched, fp32):

0. grammar: rows with a ``TokenMask`` (structured outputs) get ``-inf`` on every
   token their grammar forbids, in the logits themselves, before anything else
   (logprobs, like vLLM's default raw logprobs, are then of the masked
   distribution); the engine folds ``min_tokens`` into their bitmask;
1. the request's token rules, in vLLM's order: ``allowed_token_ids`` (every other
   token ``-inf``), ``bad_words`` (``-inf`` on a one-token word, and on the last
   token of a longer word whose other tokens end the output so far),
   ``min_tokens`` (EOS and ``stop_token_ids`` ``-inf`` while the output is shorter),
   then ``logit_bias`` added;
2. penalties: repetition (HF-style, over prompt + output tokens), then
   frequency / presence (OpenAI-style, over output token counts);
3. greedy rows: argmax of the processed logits;
4. other rows: temperature, top-k, top-p, min-p, then one draw through the
   exponential race ``argmax(probs / E)``, ``E ~ Exp(1)``. A seeded row draws
   its noise from its own generator, so it samples the same tokens whatever
   else is in the batch.

Logprobs come from ``log_softmax`` of the raw logits (after a grammar's mask, before
the token rules, penalties and temperature), with each token's rank in the vocabulary.
The results reach the host in a single transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ingot.sampling_params import SamplingParams

_U64 = (1 << 64) - 1
NO_TOKEN = ("no token is left to sample: allowed_token_ids, bad_words, min_tokens and the structured output "
            "together exclude every token")
_BIT_TABLES: Dict[torch.device, torch.Tensor] = {}  # per device: byte value -> its 8 bits, low first


@dataclass
class SamplingRow:
    """One sequence of the batch being sampled."""

    params: SamplingParams
    prompt_token_ids: List[int]
    output_token_ids: List[int]
    # The request's own generator when params.seed is set (see make_generator).
    generator: Optional[torch.Generator]
    eos_token_ids: Tuple[int, ...] = ()


# (token id, logprob, rank) of the sampled token first, then of the top-n tokens (ranks 1..n);
# the sampled token may appear twice (as sampled and among the top-n) with the same values.
TokenLogprobs = List[Tuple[int, float, int]]


@dataclass
class TokenMask:
    """The tokens each constrained row may take: ``bitmask`` (int32 ``[len(rows), ceil(V / 32)]``,
    bit ``t % 32`` of word ``t // 32`` set where token t is allowed; on the host or the device)
    for the batch rows ``rows``; the other rows are unconstrained."""

    rows: List[int]
    bitmask: torch.Tensor

    def select(self, row: int) -> Optional["TokenMask"]:
        """The mask of batch row ``row`` alone, as row 0 (None if it is unconstrained)."""
        if row not in self.rows:
            return None
        k = self.rows.index(row)
        return TokenMask([0], self.bitmask[k : k + 1])


@torch.inference_mode()  # the logits are inference tensors: in place only in that mode
def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """Set the logits of the tokens ``mask`` forbids to ``-inf``, in place. Unpacked through
    a byte table: the temporaries are ``len(mask.rows) x V`` bytes, never a 32-bit word per token."""
    device, vocab = logits.device, logits.shape[1]
    table = _BIT_TABLES.get(device)
    if table is None:
        byte = torch.arange(256, dtype=torch.int32)[:, None]
        table = _BIT_TABLES[device] = ((byte >> torch.arange(8, dtype=torch.int32)) & 1).bool().to(device)
    words = mask.bitmask.to(device, non_blocking=True).contiguous()
    m = words.shape[0]
    # little-endian words: byte k of word w holds tokens 32w + 8k .. 32w + 8k + 7
    allowed = table[words.view(torch.uint8).long()].view(m, -1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))  # beyond the mask: forbidden
    _forbid(logits, mask.rows, allowed[:, :vocab].logical_not_())


def _forbid(logits: torch.Tensor, rows: List[int], forbidden: torch.Tensor) -> None:
    """Set ``logits[rows[k], t]`` to ``-inf`` where ``forbidden[k, t]`` (bool ``[len(rows), V]``), in place."""
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits.masked_fill_(forbidden, float("-inf"))
        return
    idx = _h2d(rows, logits.device)
    logits.index_copy_(0, idx, logits.index_select(0, idx).masked_fill_(forbidden, float("-inf")))


@dataclass
class SamplerOutput:
    token_ids: List[int]
    # Per row: None unless params.logprobs is set.
    logprobs: List[Optional[TokenLogprobs]]
    # Per row: why sampling that row failed (its token is then -1); None when every row sampled.
    errors: Optional[List[Optional[str]]] = None
    # Per batch row that asked (prefill only): one entry list per prompt token the step predicted.
    prompt_logprobs: Optional[Dict[int, List[TokenLogprobs]]] = None


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed`` (any int, taken mod 2**64)."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(int(seed) & _U64)
    return gen


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _bad_word_bans(words: List[List[int]], output: List[int]) -> List[int]:
    """The tokens ``words`` (token id sequences) forbid after ``output``: a one-token word's
    token, and a longer word's last token where ``output`` ends with its other tokens."""
    n = len(output)
    return [w[-1] for w in words if len(w) - 1 <= n and output[n - len(w) + 1 :] == w[:-1]]


def no_token_left(x: torch.Tensor) -> torch.Tensor:
    """[B] bool: the rows of processed logits ``x`` ([B, V]) whose rules leave every token at ``-inf``."""
    return torch.isneginf(x.amax(dim=-1))


def _needs_min_tokens_mask(row: SamplingRow) -> bool:
    p = row.params
    return len(row.output_token_ids) < p.min_tokens and bool(row.eos_token_ids or p.stop_token_ids)


def _h2d(data, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A host list as a tensor on ``device``. The copy is issued non-blocking:
    CUDA stages pageable memory at once, so this never waits for the GPU."""
    t = torch.tensor(data, dtype=dtype)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def _padded_ids(lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[n, L] int64 of the lists padded with ``vocab``; ids outside [0, vocab) map to ``vocab``."""
    width = max(1, max(len(x) for x in lists))
    rows = [list(x) + [vocab] * (width - len(x)) for x in lists]
    ids = _h2d(rows, device)
    return torch.where((ids < 0) | (ids > vocab), vocab, ids)


class Sampler:
    """Samples one token per row from a batch of logits."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.generator = make_generator(seed, device)
        self.device = self.generator.device

    def __call__(self, logits: torch.Tensor, rows: List[SamplingRow], mask: Optional[TokenMask] = None) -> SamplerOutput:
        return self.sample(logits, rows, mask).to_host()

    def sample(self, logits: torch.Tensor, rows: List[SamplingRow], mask: Optional[TokenMask] = None) -> "DeviceSample":
        """Sample on the device; nothing waits for the GPU until ``DeviceSample.to_host``.
        ``mask``: the grammar-constrained rows' allowed tokens, applied to ``logits`` in place."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
        batch = logits.shape[0]
        if batch == 0:
            return DeviceSample(torch.empty(0, dtype=torch.int64, device=logits.device))
        masked: frozenset = frozenset()
        if mask is not None and mask.rows:
            apply_token_mask(logits, mask)
            masked = frozenset(mask.rows)
        # one pass over the rows (this runs for every sequence on every step)
        params = [r.params for r in rows]
        want_lp: list[int] = []
        pen_rows: list[int] = []
        mask_rows: list[int] = []
        rule_rows: list[int] = []
        greedy: list[bool] = []
        for i, r in enumerate(rows):
            p = r.params
            if p.logprobs is not None:
                want_lp.append(i)
            if _has_penalty(p):
                pen_rows.append(i)
            if p.min_tokens and _needs_min_tokens_mask(r) and i not in masked:
                mask_rows.append(i)
            if p.has_token_rules:
                rule_rows.append(i)
            greedy.append(p.greedy)

        if all(greedy) and not pen_rows and not want_lp and not mask_rows and not rule_rows:
            # Fast path: argmax is exact in any float dtype.
            return DeviceSample(logits.argmax(dim=-1))

        device = logits.device
        x = self._process(logits, rows, pen_rows, mask_rows, rule_rows)
        sample_rows = [i for i, g in enumerate(greedy) if not g]
        if len(sample_rows) == batch:
            tokens = self._sample(x, rows, sample_rows)
        else:
            tokens = x.argmax(dim=-1)
            if sample_rows:
                idx = _h2d(sample_rows, device)
                tokens[idx] = self._sample(x[idx], rows, sample_rows)
        # a row whose rules exclude every token fails (token -1 on the host) rather than taking
        # token 0; the device keeps its token for a step queued behind this one
        failed = tokens.masked_fill(no_token_left(x), -1) if rule_rows else None
        if not want_lp:
            return DeviceSample(tokens, failed=failed)
        return self._with_logprobs(logits, tokens, params, want_lp, failed)

    def process_logits(self, logits: torch.Tensor, rows: List[SamplingRow]) -> torch.Tensor:
        """fp32 [B, V]: ``logits`` after the token rules, ``min_tokens`` and the penalties (what
        greedy rows take the argmax of); ``logits`` itself when it is fp32 and nothing applies."""
        pen_rows = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
        mask_rows = [i for i, r in enumerate(rows) if _needs_min_tokens_mask(r)]
        rule_rows = [i for i, r in enumerate(rows) if r.params.has_token_rules]
        return self._process(logits, rows, pen_rows, mask_rows, rule_rows)

    # -- steps --------------------------------------------------------------

    def _process(self, logits: torch.Tensor, rows: List[SamplingRow],
                 pen_rows: List[int], mask_rows: List[int], rule_rows: List[int]) -> torch.Tensor:
        device, vocab = logits.device, logits.shape[1]
        # a copy only where it is written (the logits are fp32 already: layers.linear.logits_linear)
        x = logits.to(torch.float32, copy=bool(pen_rows or mask_rows or rule_rows))
        allowed = [i for i in rule_rows if rows[i].params.allowed_token_ids]
        if allowed:
            ids = _padded_ids([rows[i].params.allowed_token_ids for i in allowed], vocab, device)
            others = torch.ones(len(allowed), vocab + 1, dtype=torch.bool, device=device).scatter_(1, ids, False)
            _forbid(x, allowed, others[:, :vocab])
        banned = []  # row-major offsets of the (row, token) pairs bad_words and min_tokens forbid
        flat, bias = [], []  # logit_bias: row-major offsets and what they add
        for i in rule_rows:
            p = rows[i].params
            if p.bad_words_token_ids:
                bans = _bad_word_bans(p.bad_words_token_ids, rows[i].output_token_ids)
                banned += [i * vocab + t for t in bans if 0 <= t < vocab]
            for t, b in (p.logit_bias or {}).items():
                if 0 <= t < vocab:
                    flat.append(i * vocab + t)
                    bias.append(b)
        for i in mask_rows:
            ids = set(rows[i].eos_token_ids) | set(rows[i].params.stop_token_ids)
            banned += [i * vocab + t for t in sorted(ids) if 0 <= t < vocab]
        if banned:
            # index_fill_ with a Python scalar: no host-to-device scalar copy (no sync).
            x.view(-1).index_fill_(0, _h2d(banned, device), float("-inf"))
        if flat:  # (after the -inf: the bias of a forbidden token leaves it forbidden)
            x.view(-1).index_add_(0, _h2d(flat, device), _h2d(bias, device, torch.float32))
        if pen_rows:
            self._apply_penalties(x, rows, pen_rows)
        return x

    @staticmethod
    def _apply_penalties(x: torch.Tensor, rows: List[SamplingRow], pen_rows: List[int]) -> None:
        device, vocab = x.device, x.shape[1]
        rep = [i for i in pen_rows if rows[i].params.repetition_penalty != 1.0]
        if rep:
            ids = _padded_ids(
                [list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids) for i in rep],
                vocab, device)
            seen = torch.zeros(len(rep), vocab + 1, dtype=torch.bool, device=device)
            seen.scatter_(1, ids, True)
            seen = seen[:, :vocab]
            idx = _h2d(rep, device)
            pen = _h2d([rows[i].params.repetition_penalty for i in rep], device, torch.float32)[:, None]
            sub = x[idx]
            penalised = torch.where(sub > 0, sub / pen, sub * pen)
            x[idx] = torch.where(seen, penalised, sub)
        pf = [i for i in pen_rows
              if rows[i].params.presence_penalty != 0.0 or rows[i].params.frequency_penalty != 0.0]
        if pf:
            ids = _padded_ids([rows[i].output_token_ids for i in pf], vocab, device)
            counts = torch.zeros(len(pf), vocab + 1, dtype=torch.float32, device=device)
            counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
            counts = counts[:, :vocab]
            coef = _h2d([[rows[i].params.frequency_penalty, rows[i].params.presence_penalty]
                         for i in pf], device, torch.float32)
            idx = _h2d(pf, device)
            x[idx] = x[idx] - coef[:, :1] * counts - coef[:, 1:] * (counts > 0).to(torch.float32)

    def _sample(self, x: torch.Tensor, rows: List[SamplingRow], which: List[int]) -> torch.Tensor:
        """Sample one token per row of ``x`` (already restricted to ``which``)."""
        probs = self.probs(x, rows, which)
        device = probs.device
        n, vocab = probs.shape
        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(which) if rows[i].generator is None]
        if len(unseeded) == n:
            noise.exponential_(generator=self.generator)
        else:
            for j, i in enumerate(which):
                gen = rows[i].generator
                if gen is not None:
                    noise[j].exponential_(generator=gen)
            if unseeded:
                idx = _h2d(unseeded, device)
                noise[idx] = torch.empty(len(unseeded), vocab, device=device).exponential_(
                    generator=self.generator)
        # exponential_ may return exactly 0; keep 0/0 (NaN) away from argmax.
        noise.clamp_min_(torch.finfo(torch.float32).tiny)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def probs(x: torch.Tensor, rows: List[SamplingRow], which: List[int]) -> torch.Tensor:
        """The distribution each row of ``x`` (rows ``which`` of the batch, processed logits)
        samples from: temperature, top-k, top-p, then min-p. Speculative verification
        (``spec_verify.py``) tests drafts against these same probabilities."""
        device = x.device
        n, vocab = x.shape
        ps = [rows[i].params for i in which]
        ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in ps]
        use_k = any(ks)
        use_p = any(p.top_p < 1.0 for p in ps)
        use_min_p = any(p.min_p > 0.0 for p in ps)
        knobs = _h2d([[p.temperature, p.top_p, k, p.min_p] for p, k in zip(ps, ks)],
                     device, torch.float32)
        x = x / knobs[:, 0:1]

        if use_k or use_p:
            sv, si = torch.sort(x, dim=-1, descending=True, stable=True)
            keep = torch.ones_like(sv, dtype=torch.bool)
            if use_k:
                k = knobs[:, 2:3]
                pos = torch.arange(vocab, device=device, dtype=torch.float32)[None, :]
                keep = (k <= 0) | (pos < k)
                sv = sv.masked_fill(~keep, float("-inf"))
            if use_p:
                probs = sv.softmax(dim=-1)
                cum = probs.cumsum(dim=-1)
                # Mass of the strictly better tokens: keep while it is still < top_p.
                before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
                top_p = knobs[:, 1:2]
                keep_p = (before < top_p) | (top_p >= 1.0)
                keep_p[:, 0] = True
                keep = keep & keep_p
            drop = torch.empty_like(keep).scatter_(1, si, ~keep)
            x = x.masked_fill(drop, float("-inf"))

        probs = x.softmax(dim=-1)
        if use_min_p:
            floor = knobs[:, 3:4] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs

    @staticmethod
    def _with_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: List[SamplingParams], want: List[int],
                       failed: Optional[torch.Tensor] = None) -> "DeviceSample":
        device = logits.device
        idx = _h2d(want, device)
        lp = torch.log_softmax(logits[idx].to(torch.float32), dim=-1)
        chosen = tokens[idx]
        chosen_lp = lp.gather(1, chosen[:, None])
        chosen_rank = (lp > chosen_lp).sum(dim=-1) + 1  # 1 = the most likely token
        top_n = min(max(params[i].logprobs for i in want), logits.shape[1])
        parts = [chosen_lp[:, 0].to(torch.float64), chosen_rank.to(torch.float64)]
        if top_n:
            top_v, top_i = lp.topk(top_n, dim=-1)
            parts += [top_v.to(torch.float64).flatten(), top_i.to(torch.float64).flatten()]
        ns = [params[i].logprobs for i in want]
        return DeviceSample(tokens, torch.cat(parts), want, ns, top_n, failed)


class DeviceSample:
    """A step's sampled tokens (and logprobs) on the device. ``start_copy`` starts their
    copy to the host without waiting; ``to_host`` waits for it and returns host lists."""

    def __init__(self, tokens: torch.Tensor, lp_flat: Optional[torch.Tensor] = None, want: Sequence[int] = (),
                 ns: Sequence[int] = (), top_n: int = 0, failed: Optional[torch.Tensor] = None) -> None:
        self.tokens = tokens  # [B] int64 on the device (what a next step may read there)
        self._failed = failed  # ``tokens`` with -1 at the rows that could take no token (for the host)
        self._lp = lp_flat
        self._want, self._ns, self._top_n = list(want), list(ns), top_n
        self._host: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None
        self._event: Optional[torch.cuda.Event] = None

    def start_copy(self) -> None:
        """Copy to pinned host memory, non-blocking, and record an event after it."""
        if self._host is not None:
            return
        tokens = self.tokens if self._failed is None else self._failed
        if tokens.device.type != "cuda":
            self._host = (tokens, self._lp)
            return
        host = lambda t: None if t is None else t.to("cpu", non_blocking=True)  # noqa: E731 (pinned)
        self._host = (host(tokens), host(self._lp))
        self._event = torch.cuda.Event()
        self._event.record()

    def to_host(self) -> SamplerOutput:
        self.start_copy()
        if self._event is not None:
            self._event.synchronize()
        tokens_t, lp_t = self._host
        token_ids = tokens_t.tolist()
        batch = len(token_ids)
        errors = None
        if self._failed is not None and min(token_ids) < 0:
            errors = [NO_TOKEN if t < 0 else None for t in token_ids]
        if lp_t is None:
            return SamplerOutput(token_ids, [None] * batch, errors)
        flat = lp_t.tolist()
        m, top_n = len(self._want), self._top_n
        chosen_vals, ranks = flat[:m], flat[m : 2 * m]
        top_vals = flat[2 * m : 2 * m + m * top_n]
        top_ids = flat[2 * m + m * top_n :]
        out: List[Optional[TokenLogprobs]] = [None] * batch
        for j, i in enumerate(self._want):
            entries = [(token_ids[i], chosen_vals[j], int(ranks[j]))]
            for r in range(min(self._ns[j], top_n)):
                entries.append((int(top_ids[j * top_n + r]), top_vals[j * top_n + r], r + 1))
            out[i] = entries
        return SamplerOutput(token_ids, out, errors)
