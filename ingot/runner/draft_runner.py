"""Draft-model speculative decoding, the device side: a second, smaller model proposes each
sequence's drafts greedily, on the target's device, before the target verifies them.

The draft is a ``ModelRunner`` of its own (model, KV pool, decode graphs), held by the
target's runner (``DraftedModelRunner``). Its KV pool has the target's number of blocks and
block size, so the block ids and slots the engine hands out for the target index the draft's
pool too: one block manager serves both. The draft runs only on the steps the engine asks for
(``engine/speculative.py``); each sequence's draft K/V is written for its first
``draft_kv_len`` tokens (its frontier), which may trail the target's:

* a plain prefill or decode step with ``batch.draft_follows`` (the next step may speculate):
  the draft runs on the same inputs (``fill_kv``: its K/V, no logits), after the target's
  sampling is queued; a step without it (above ``disable_by_batch_size``, or no sequence
  may speculate) costs the draft nothing;
* a verify step first runs a draft round (``propose``): one step of decode rows, each
  sequence's last token (and, where the frontier is one short, the token before it: e.g. the
  last draft of a round that kept every draft, proposed but never fed), then ``k - 1``
  one-row steps that feed each draft to get the next. A greedy request's drafts are the
  draft's argmax over the shared vocabulary; a sampled request's are drawn from the draft's
  distribution under its sampling parameters, which the verification needs as well
  (``batch.draft_probs``: ``min(1, p / q)``). Then the verify step is staged with them.

Before the draft runs on a step, a row whose frontier trails further than that one token
is caught up (``_catch_up``): eager prefill chunks of the draft over its missing tokens
(they are on the host; only a decode step's own last token may still be on the device).
So every step the draft runs on leaves each of its rows' draft K/V complete up to the step's
tokens. A draft position the target rejects lies past the kept tokens: it is written again
before any query reads it, as the target's own rejected K/V. Every step but a prefill or a
catch-up is decode rows, so on CUDA each replays one of the draft's graphs (decode graphs;
with a row one short, a set of ``store_first`` graphs of up to two rows per sequence;
following a decode step, K/V-only graphs without the lm_head), captured at start-up into the
target's graph pool, up to the batch sizes that speculate.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch
from torch import nn

from ingot.config import EngineConfig, spec_error
from ingot.loading.checkpoint import Checkpoint, open_checkpoint
from ingot.loading.dummy import SHAPES
from ingot.loading.errors import CheckpointError
from ingot.loading.model_config import ModelConfig
from ingot.models.loader import held_dense, load_checkpoint
from ingot.runner.batch import BatchSequence, ScheduledBatch, draft_kv_lag
from ingot.runner.kv_pool import KVCachePool
from ingot.runner.model_runner import LaunchedStep, ModelRunner, TokenFeed, sampling_rows
from ingot.runner.spec_verify import sample_drafts
from ingot.runner.step_inputs import HostStep, StepInputs, decode_rows, device_inputs, prefill_rows

log = logging.getLogger(__name__)


class DraftedModelRunner(ModelRunner):
    """The target's runner with a draft model beside it (``speculative_config.model``).

    ``propose_vocab``: drafts are drawn from token ids ``[0, propose_vocab)``, the ids both
    tokenizers share and both embedding tables hold (a padded table's extra rows are never
    proposed). Target tokens past the draft's table (a padded target's, never sampled by a
    trained model) are fed to the draft as its last row, only costing acceptance."""

    position_shift = 0  # where the draft reads each token, relative to the target (``first_rows``)
    lag_rows = 1  # the most tokens a round's first step feeds before each sequence's last (``first_rows``)

    def __init__(self, model: nn.Module, model_config: ModelConfig, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype, draft: ModelRunner, propose_vocab: int) -> None:
        super().__init__(model, model_config, config, device, dtype)
        self.draft = draft
        self.propose_vocab = propose_vocab
        self.draft_max_id = draft.model_config.vocab_size - 1
        self.clamp_ids = model_config.vocab_size > draft.model_config.vocab_size

    # ------------------------------------------------------------------ KV cache and graphs
    def _bytes_per_block(self) -> int:
        """A block of the target's pool and one of the draft's: the engine sizes them together."""
        return super()._bytes_per_block() + self.draft._bytes_per_block()

    def weight_bytes(self) -> int:
        return super().weight_bytes() + self.draft.weight_bytes()

    def allocate_kv_cache(self, num_blocks: int) -> KVCachePool:
        self.draft.allocate_kv_cache(num_blocks)
        return super().allocate_kv_cache(num_blocks)

    def release_kv_cache(self) -> None:
        super().release_kv_cache()
        self.draft.release_kv_cache()

    def setup_decode_graphs(self, max_blocks_per_seq: int) -> None:
        """The target's decode and verify graphs and the draft's three sets, all into one
        memory pool, up to the most sequences that speculate at once (the draft runs on no
        larger step): its decode graphs (the draft steps), its first-step graphs (up to two
        rows per sequence) and K/V-only decode graphs (following the target's decode steps:
        no lm_head, no logits kept in the pool)."""
        from ingot.runner.graph_runner import DecodeGraphRunner, capture_sets, capture_sizes, graphs_enabled, verify_buckets

        if not graphs_enabled(self.config, self.device):
            return
        spec = self.config.speculative_config
        assert spec is not None and self.config.max_num_seqs is not None
        most = min(self.config.max_num_seqs, spec.disable_by_batch_size)
        d = self.draft
        args = (d.model, d.config, d.device, max_blocks_per_seq, d.policy, d.tp)
        buckets = [s for s in capture_sizes(d.config) if s < most] + [most]
        d.graphs = DecodeGraphRunner(*args, buckets=buckets)
        d.verify_graphs = DecodeGraphRunner(*args, store_first=True, buckets=verify_buckets((1 + self.lag_rows) * most))
        d.kv_graphs = DecodeGraphRunner(*args, buckets=buckets, logits=False)
        capture_sets(self.graph_sets(max_blocks_per_seq) + [d.graphs, d.verify_graphs, d.kv_graphs])

    # ------------------------------------------------------------------ steps
    def launch(self, batch: ScheduledBatch, eos_token_ids: tuple[int, ...], feed: Optional[TokenFeed] = None) -> LaunchedStep:
        """A verify step: the draft round first (it sets ``batch.draft_tokens``), then the
        target's verify step. Any other step: the target's, then, if the engine asks
        (``batch.draft_follows``), the draft's K/V of it."""
        if batch.draft_tokens is not None:
            self.propose(batch, eos_token_ids)
            return super().launch(batch, eos_token_ids, feed)
        inputs = self.stage(batch)
        if feed is not None:
            feed.apply(inputs, batch)
        step = self.launch_staged(batch, inputs, eos_token_ids)
        if batch.draft_follows:
            self.follow(batch, inputs, feed)
        return step

    def follow(self, batch: ScheduledBatch, inputs: StepInputs, feed: Optional[TokenFeed]) -> None:
        """The draft's K/V of a prefill or decode step the target has queued: the same inputs
        once every row's frontier has caught up to the step's first token, or for a decode
        step with a row one token short, decode rows that feed that token too. A draft that
        reads its tokens a position back (an EAGLE head) feeds a prefill step's tokens as a
        catch-up and a decode step's as decode rows (with any tokens it lacks before them)."""
        seqs = batch.seqs
        if batch.is_prefill and self.position_shift:  # (its rows are the step's tokens, one position back)
            self._catch_up(seqs, [seq.num_computed_tokens + n for seq, n in zip(seqs, batch.num_new_tokens)])
            return
        if batch.is_prefill:  # (no token of a prefill step is pending on the device)
            self._catch_up(seqs, [seq.num_computed_tokens for seq in seqs])
        if not self.position_shift and (batch.is_prefill or not any(draft_kv_lag(seq) for seq in seqs)):
            self.draft.fill_kv(self._clamped(inputs, owned=False))
            return
        self._catch_up(seqs, [seq.num_computed_tokens - self.lag_rows for seq in seqs])
        rows = device_inputs(first_rows(seqs, self.block_size, self.position_shift, self.lag_rows), self.device)
        if feed is not None:  # the decode rows come first, in batch order: the feed's rows
            feed.apply(rows, batch)
        self.draft.fill_kv(self._clamped(rows, owned=True))

    def _catch_up(self, seqs: list[BatchSequence], ends: list[int]) -> None:
        """The draft's K/V of each sequence's tokens ``[draft_kv_len, end)`` (steps it sat
        out, or a prefix-cache hit that brought the target's K/V alone), as prefill chunks with
        context: eager (rare: once per return to speculation), at most
        ``max_num_batched_tokens`` tokens a forward, the most a prefill step takes."""
        budget = self.config.max_num_batched_tokens
        chunk: list[BatchSequence] = []
        spans: list[tuple[int, int]] = []
        used = 0
        for seq, end in zip(seqs, ends):
            start = max(seq.draft_kv_len, -self.position_shift)  # (no position before the first)
            while start < end:
                if used == budget:  # this chunk runs; the rest goes on in the next
                    self._fill_chunk(chunk, spans)
                    chunk, spans, used = [], [], 0
                n = min(end - start, budget - used)
                chunk.append(seq)
                spans.append((start, start + n))
                used, start = used + n, start + n
        if spans:
            self._fill_chunk(chunk, spans)

    def _fill_chunk(self, seqs: list[BatchSequence], spans: list[tuple[int, int]]) -> None:
        host = prefill_rows(seqs, spans, [False] * len(seqs), self.block_size, self.position_shift)
        self.draft.fill_kv(self._clamped(device_inputs(host, self.device), owned=True))

    @torch.inference_mode()
    def propose(self, batch: ScheduledBatch, eos_token_ids: tuple[int, ...]) -> None:
        """Replace each sequence's placeholder drafts (``batch.draft_tokens``: how many it may
        take) with the draft model's: its argmax for greedy requests, a sample of its
        distribution under the request's parameters for the others (``batch.draft_probs``).
        Every sequence of the step gets its missing draft K/V, drafts or not (the few with
        none are rows of a forward that runs anyway). One read-back."""
        assert batch.draft_tokens is not None
        seqs, counts = batch.seqs, [len(d) for d in batch.draft_tokens]
        self._catch_up(seqs, [seq.num_computed_tokens - self.lag_rows for seq in seqs])
        n, steps = len(seqs), max(counts)
        rows = sampling_rows(batch, range(n), eos_token_ids)
        sampled = {i for i in range(n) if counts[i] and not rows[i].params.greedy}
        starts = [0]
        for k in counts:  # each sequence's first position in the verify step
            starts.append(starts[-1] + k + 1)
        probs = torch.zeros(starts[-1], self.propose_vocab, device=self.device) if sampled else None

        def pick(logits: torch.Tensor, active: list[int], j: int) -> torch.Tensor:
            """Draft ``j`` of the ``active`` sequences, from their rows of ``logits``."""
            logits = logits[:, : self.propose_vocab]
            tokens = logits.argmax(dim=-1)
            which = [r for r, i in enumerate(active) if i in sampled]
            if which:
                at = torch.tensor(which, dtype=torch.int64).to(self.device, non_blocking=True)
                drawn, q = sample_drafts(self.sampler, logits.index_select(0, at), [rows[active[r]] for r in which])
                tokens[at] = drawn
                probs[torch.tensor([starts[active[r]] + j for r in which]).to(self.device, non_blocking=True)] = q
            return tokens

        shift = self.position_shift
        first = device_inputs(first_rows(seqs, self.block_size, shift, self.lag_rows), self.device)
        logits = self.draft.forward_logits(self._clamped(first, owned=True))
        drafts = torch.zeros(n, max(steps, 1), dtype=torch.int64, device=self.device)
        drafts[:, 0] = pick(logits[:n], list(range(n)), 0)
        self._chain_start(n)
        active: list[int] = []
        step: Optional[StepInputs] = None
        for j in range(1, steps):  # feed draft j - 1 of every sequence that takes more than j drafts
            keep = [i for i, k in enumerate(counts) if k > j]
            if step is not None and keep == active:  # the same rows, one position on
                advance_rows(step, self.block_size)
            else:
                chosen = [seqs[i] for i in keep]
                step = device_inputs(decode_rows([s.block_ids for s in chosen], [0] * len(chosen),
                                                 [s.num_computed_tokens + j + shift for s in chosen], self.block_size,
                                                 store_first=False), self.device)
                index = torch.tensor(keep, dtype=torch.int64).to(self.device, non_blocking=True)
            active = keep
            step.input_ids.copy_(drafts[:, j - 1].index_select(0, index))
            self._chain_feed(step, index)
            drafts[index, j] = pick(self.draft.forward_logits(step), active, j)
            self._chain_kept(index)
        host = drafts.tolist()
        for i, k in enumerate(counts):
            batch.draft_tokens[i] = host[i][:k]
        batch.draft_probs = probs

    # A draft model reads tokens alone; an EAGLE head also reads a hidden state per row, its own
    # output at the position before for the drafts it feeds itself (``eagle_runner.py``).
    def _chain_start(self, n: int) -> None:
        """After a round's first step: its first ``n`` rows (one per sequence) begin the chain."""

    def _chain_feed(self, step: StepInputs, index: torch.Tensor) -> None:
        """Before a drafting step of the sequences ``index`` (rows of ``step``)."""

    def _chain_kept(self, index: torch.Tensor) -> None:
        """After that step."""

    def _clamped(self, inputs: StepInputs, owned: bool) -> StepInputs:
        """``inputs`` with target tokens past the draft's embedding table fed as its last row
        (in place where the inputs are the draft's own)."""
        if not self.clamp_ids:
            return inputs
        if owned:
            inputs.input_ids.clamp_(max=self.draft_max_id)
            return inputs
        return dataclasses.replace(inputs, input_ids=inputs.input_ids.clamp(max=self.draft_max_id))


def first_rows(seqs: list[BatchSequence], block_size: int, shift: int = 0, lag_rows: int = 1) -> HostStep:
    """The draft's first step of a round, as decode rows: each sequence's last token (at
    ``num_computed_tokens``; a token still pending on the device is fed in later), in batch
    order, then the up to ``lag_rows`` tokens before it where the draft lacks their K/V
    (``draft_kv_lag``: one after a draft model's round that kept every draft, the kept drafts
    after an EAGLE head's round; anything earlier already caught up). With such rows the step stores every row's
    K/V first; only the first rows have logits. ``shift``: each token's position relative to
    the target's (an EAGLE head reads token ``t + 1`` at position ``t``: -1)."""
    tables, ids, positions = [], [], []
    for seq in seqs:
        out = seq.output_token_ids
        tables.append(seq.block_ids)
        ids.append(out[-1] if out else seq.prompt_token_ids[-1])
        positions.append(seq.num_computed_tokens + shift)
    for seq in seqs:
        first = max(seq.num_computed_tokens - min(draft_kv_lag(seq), lag_rows), -shift)
        for before in range(first, seq.num_computed_tokens):
            tables.append(seq.block_ids)
            ids.extend(seq.tokens(before, before + 1))
            positions.append(before + shift)
    step = decode_rows(tables, ids, positions, block_size, store_first=len(ids) > len(seqs))
    step.logits_indices = step.sample_rows = list(range(len(seqs)))
    return step


def advance_rows(inputs: StepInputs, block_size: int) -> None:
    """One-row-per-sequence decode inputs moved one position on, in place on the device (no
    host work between a round's draft steps): each row's block table already holds the new
    position (the scheduler grew every sequence's blocks for its drafts)."""
    attn, positions = inputs.attn, inputs.positions
    positions.add_(1)
    attn.seq_lens.add_(1)
    blocks = attn.block_tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
    attn.slot_mapping.copy_(blocks.to(torch.int64) * block_size + positions % block_size)


# ---------------------------------------------------------------------- start-up
def load_draft(config: EngineConfig, target: Checkpoint, device: torch.device, dtype: torch.dtype,
               max_model_len: int) -> tuple[ModelRunner, int]:
    """The draft model ``config.speculative_config`` names, loaded on ``device`` in the target's
    dtype, and the token ids it may propose (``shared_vocab_size``); ``ConfigError`` when it
    cannot be opened or does not fit the target. A built-in shape takes random weights and the
    engine's ``tokenizer`` (like a target shape); otherwise the engine's ``load_format`` applies."""
    spec = config.speculative_config
    assert spec is not None and spec.model is not None
    name = spec.model
    shape = name in SHAPES
    try:
        ckpt = open_checkpoint(name, config.tokenizer if shape else None, "dummy" if shape else config.load_format,
                               spec.quantization, dequantize_on_load=device.type != "cuda", held_dense=held_dense)
    except (CheckpointError, OSError) as exc:
        raise spec_error(f"the draft model {name!r} cannot be opened: {exc}") from None
    vocab = shared_vocab_size(target, ckpt, name)
    window, draft_window = target.config.kv_window, ckpt.config.kv_window
    if window is not None and (draft_window is None or draft_window > window):
        raise spec_error(f"the target attends within {window} tokens in every layer (its KV blocks before that "
                           f"are handed back), but the draft model {name!r} attends "
                           f"{'to the whole context' if draft_window is None else f'within {draft_window}'}")
    try:
        model = load_checkpoint(ckpt, dtype, device, max_model_len, progress=config.show_progress)
    except CheckpointError as exc:
        raise spec_error(f"the draft model {name!r} cannot be loaded: {exc}") from None
    log.info("draft model %s: %d layers, vocabulary %d (proposals over the %d shared token ids)", ckpt.source,
             ckpt.config.num_layers, ckpt.config.vocab_size, vocab)
    draft_config = config.replace(decode_compile=False)  # its graphs replay its raw forward
    return ModelRunner(model, ckpt.config, draft_config, device, dtype), vocab


def shared_vocab_size(target: Checkpoint, draft: Checkpoint, name: str) -> int:
    """The token ids a draft may propose: ``[0, n)`` where both tokenizers give every string
    the same id (one vocabulary may extend the other) and both embedding tables have rows
    (padded tables, as Qwen2.5-7B's 152,064 rows against Qwen2.5-1.5B's 151,936, are fine).
    ``ConfigError`` when the vocabularies disagree or the draft's table misses real tokens."""
    a, b = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    small, large = (a, b) if len(a) <= len(b) else (b, a)
    differ = [(text, i, large.get(text)) for text, i in small.items() if large.get(text) != i]
    if differ:
        examples = ", ".join(f"{t!r}: {i} vs {j}" for t, i, j in sorted(differ, key=lambda d: d[1])[:3])
        raise spec_error(f"the draft model {name!r} has another vocabulary than the target: {len(differ)} of "
                           f"{len(small)} tokens differ ({examples}); a draft model must share the target's tokenizer")
    tokens = max(small.values(), default=-1) + 1
    if draft.config.vocab_size < tokens:
        raise spec_error(f"the draft model {name!r} embeds {draft.config.vocab_size} token ids, fewer than the "
                           f"{tokens} of the vocabulary")
    return min(tokens, target.config.vocab_size, draft.config.vocab_size)
