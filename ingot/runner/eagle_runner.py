"""EAGLE speculative decoding, the device side: an EAGLE-1 or EAGLE-3 head (``models/eagle.py``)
drafts from the target's hidden states, through the draft model's machinery
(``draft_runner.py``: the same rounds, frontiers, catch-up and graphs).

The head reads token ``t + 1`` at position ``t`` (``position_shift = -1``): where a draft
model's row feeds token ``t`` at ``t``, the head's feeds it at ``t - 1``, with the hidden state
the target computed there; a sequence's first token is never fed. So every rule about which
tokens the draft has seen (``Sequence.draft_kv_len``, ``draft_kv_lag``) holds unchanged.

The hidden states sit in a paged cache beside the KV cache (``EagleSink``: a row of H values
per KV slot, in the pool's budget): the target's forward writes every token's row (prefill,
decode and verify steps alike, in its graphs too), so a head that sat out steps catches up
from the cache. Within a round, each drafting step's output rows are written to the slots of
the next positions, where the next step reads them; the verify step then overwrites those
slots with the target's own rows. The head's K/V of the drafts it fed itself came from its
own hidden states, so it counts as missing (``EagleSpeculator``): the next round's first step
feeds the kept drafts again, with the target's rows, as EAGLE's reference implementation does.
"""

from __future__ import annotations

import logging

import torch

from ingot.config import EngineConfig, spec_error
from ingot.loading.checkpoint import Checkpoint
from ingot.loading.eagle import EagleCheckpoint, open_eagle_head
from ingot.loading.errors import CheckpointError
from ingot.distributed.collectives import all_gather_last_dim
from ingot.layers.embedding import Embedding, LMHead
from ingot.models.eagle import EagleHead, EagleSink
from ingot.models.llama import LlamaForCausalLM
from ingot.models.loader import default_dtype
from ingot.runner.draft_runner import DraftedModelRunner
from ingot.runner.kv_pool import KVCachePool
from ingot.runner.model_runner import ModelRunner
from ingot.runner.step_inputs import StepInputs

log = logging.getLogger(__name__)


class EagleRunner(DraftedModelRunner):
    """The target's runner with an EAGLE head beside it (``speculative_config.method``
    ``eagle`` or ``eagle3``)."""

    position_shift = -1

    @property
    def lag_rows(self) -> int:
        """A round's kept drafts went through the head with its own hidden states, not the
        target's: the next round's first step feeds them again (``EagleSpeculator``)."""
        spec = self.config.speculative_config
        assert spec is not None
        return spec.num_speculative_tokens

    @property
    def head(self) -> EagleHead:
        return self.draft.model

    def _bytes_per_block(self) -> int:
        """The target's and the head's K/V of a block, and its hidden-state rows."""
        width = self.head.config.hidden_size
        return super()._bytes_per_block() + self.block_size * width * self.dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int) -> KVCachePool:
        pool = super().allocate_kv_cache(num_blocks)
        head = self.head
        cache = torch.zeros(num_blocks * self.block_size, head.config.hidden_size, dtype=self.dtype, device=self.device)
        sink = EagleSink(head.spec.aux_layers, head.fc if head.eagle3 else None, cache)
        head.sink = self.model.hidden_sink = sink
        # the most decode rows a head's step has: every sequence's last token and the ones before it
        rows = (1 + self.lag_rows) * (self.config.max_num_seqs or 1)
        head.out_hidden = torch.zeros(rows, head.config.hidden_size, dtype=self.dtype, device=self.device)
        return pool

    def release_kv_cache(self) -> None:
        super().release_kv_cache()
        self.head.sink = self.model.hidden_sink = None
        self.head.out_hidden = None

    # ------------------------------------------------------------------ a round's chain
    def _chain_start(self, n: int) -> None:
        self._chain = self.head.out_hidden[:n].clone()

    def _chain_feed(self, step: StepInputs, index: torch.Tensor) -> None:
        """The rows' hidden states: each sequence's output of the step before, at the slot the
        step reads (its row's)."""
        self.head.sink.cache.index_copy_(0, step.attn.slot_mapping, self._chain.index_select(0, index))

    def _chain_kept(self, index: torch.Tensor) -> None:
        self._chain.index_copy_(0, index, self.head.out_hidden[: index.shape[0]])


def open_eagle(config: EngineConfig, target: Checkpoint) -> EagleCheckpoint:
    """The head ``config.speculative_config`` names, checked against the target's configuration
    (before the target loads); ``ConfigError`` naming what does not fit."""
    spec = config.speculative_config
    assert spec is not None and spec.uses_eagle and spec.model is not None
    window = target.config.kv_window
    if window is not None:
        raise spec_error(f"the target attends within {window} tokens in every layer (its KV blocks and hidden rows "
                           "before that are handed back), but an EAGLE head attends to the whole context")
    try:
        return open_eagle_head(spec.model, spec.method, target.config)
    except (CheckpointError, OSError) as exc:
        raise spec_error(f"the head {spec.model!r} cannot be opened: {exc}") from None


def vocab_tables(runner: ModelRunner) -> tuple[Embedding, LMHead]:
    """The target's embedding and lm_head, for a head that shares them: the target's modules on
    one device; under tensor parallelism (run on every rank: ``run_on_ranks``) whole copies
    gathered from the ranks' vocabulary slices, since the head runs on the driver alone."""
    model, tp = runner.model, runner.tp
    if not isinstance(model, LlamaForCausalLM):
        raise spec_error(f"{type(model).__name__} does not hand hidden states to an EAGLE head")
    if not tp.enabled:
        return model.embed_tokens, model.lm_head
    vocab = model.config.vocab_size

    def whole(weight: torch.Tensor) -> torch.Tensor:  # [rows a rank, H] -> [vocab, H]
        return all_gather_last_dim(weight.t(), tp).t()[:vocab].contiguous()

    with torch.device(runner.device), default_dtype(runner.dtype):
        embed = Embedding(vocab, model.config.hidden_size)
        embed.weight.data = whole(model.embed_tokens.weight)
        tied = model.lm_head.weight is model.embed_tokens.weight
        head = LMHead(vocab, model.config.hidden_size, embed if tied else None)
        if not tied:
            head.weight.data = whole(model.lm_head.weight)
    return embed.requires_grad_(False), head.requires_grad_(False)


def load_eagle(config: EngineConfig, ckpt: EagleCheckpoint, shared: tuple[Embedding, LMHead], device: torch.device,
               dtype: torch.dtype, max_model_len: int) -> ModelRunner:
    """A runner for the head ``ckpt`` on ``device`` in the target's dtype, with the target's
    embedding and lm_head (``vocab_tables``) where the head shares them."""
    spec = config.speculative_config
    assert spec is not None and spec.model is not None
    with torch.device(device), default_dtype(dtype):
        head = EagleHead(ckpt.config, ckpt.spec, max_model_len, ckpt.config.vocab_size, shared)
    head = head.eval().requires_grad_(False)
    try:
        head.load_weights((name, t.to(device, dtype) if t.is_floating_point() else t.to(device))
                          for name, t in ckpt.tensors.items())
    except CheckpointError as exc:
        raise spec_error(f"the head {spec.model!r} cannot be loaded: {exc}") from None
    log.info("EAGLE%s head %s: drafts from %s, vocabulary %d", "-3" if head.eagle3 else "-1", ckpt.source,
             f"target layers {list(ckpt.spec.aux_layers)}" if head.eagle3 else "the target's last hidden states",
             ckpt.spec.draft_vocab_size)
    return ModelRunner(head, ckpt.config, config.replace(decode_compile=False), device, dtype)
