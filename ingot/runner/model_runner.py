"""ModelRunner: owns the model and its KV cache; turns a scheduled batch into sampled tokens.

Prefill steps, eager mode and CPU run the raw model. Decode steps on CUDA go
through the DecodeGraphRunner (captured graphs, optionally compiled) when the
batch fits a bucket; speculative decoding's verify steps (decode rows of their
own kind: ``step_inputs._verify_step``) through a second set of graphs, the
verify graphs, when their rows fit a bucket, else the same rows through the raw
model.

A step is ``stage`` (inputs to the device), ``run_model`` (the device part:
forward and logits) and sampling. ``run_model`` is what every tensor-parallel
rank runs in lockstep (``tp_runner.py``); the rest runs on the driver only.
A ModelRunner is the single-device ``Executor`` (``executor.py``).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence, TypeVar

import torch
from torch import nn

from ingot.config import ConfigError, EngineConfig
from ingot.distributed.parallel import SINGLE
from ingot.runner.kv_pool import KVCachePool, blocks_for
from ingot.runner.sampler import DeviceSample, Sampler, SamplerOutput, SamplingRow, TokenMask, make_generator
from ingot.runner.batch import ScheduledBatch
from ingot.layers.attention import AttentionMetadata
from ingot.layers.policy import OpPolicy
from ingot.loading.model_config import ModelConfig
from ingot.runner.prompt_logprobs import prompt_spans, span_entries
from ingot.runner.spec_verify import DeviceVerify, verify_drafts
from ingot.runner.step_inputs import StepInputs, build_step_inputs, last_token_indices

log = logging.getLogger(__name__)

T = TypeVar("T")
# KV pool of an engine on CPU, in tokens, unless ``num_kv_blocks`` sets its size
CPU_KV_CACHE_TOKENS = 32768


class LaunchedStep:
    """A step queued on the device: which batch rows sampled, and their samples on the way
    to the host (``collect`` waits for them)."""

    def __init__(self, rows: list[int], sample: Optional[DeviceSample | DeviceVerify] = None, prompt_logprobs: Optional[dict] = None,
                 ready: Optional[SamplerOutput] = None) -> None:
        self.rows = rows
        self.sample = sample  # None when nothing sampled or the output is already on the host
        self._prompt_logprobs = prompt_logprobs
        self._ready = ready

    @property
    def tokens(self) -> Optional[torch.Tensor]:
        """The sampled ids on the device, row ``i`` for ``rows[i]`` (None without a device sample)."""
        return None if self.sample is None else self.sample.tokens

    def collect(self) -> SamplerOutput:
        if self._ready is None:
            self._ready = self.sample.to_host()
            self._ready.prompt_logprobs = self._prompt_logprobs
        return self._ready


def sampling_rows(batch: ScheduledBatch, rows: Sequence[int], eos_token_ids: tuple[int, ...]) -> list[SamplingRow]:
    """How each of the batch's ``rows`` samples."""
    return [SamplingRow(params=seq.params, prompt_token_ids=seq.prompt_token_ids, output_token_ids=seq.output_token_ids,
                        generator=seq.generator, eos_token_ids=eos_token_ids)
            for seq in (batch.seqs[r] for r in rows)]


class TokenFeed:
    """Input ids that a step in flight has sampled but the host has not seen yet: batch row
    ``r`` of the next step takes ``tokens[src[r]]`` as its last token where ``src[r] >= 0``."""

    def __init__(self, tokens: torch.Tensor, src: list[int]) -> None:
        self.tokens = tokens
        self.src = src

    def apply(self, inputs: StepInputs, batch: ScheduledBatch) -> None:
        last = last_token_indices(batch)
        dst = [last[r] for r, i in enumerate(self.src) if i >= 0]
        if not dst:
            return
        idx = torch.tensor(dst + [i for i in self.src if i >= 0], dtype=torch.int64)
        idx = idx.to(inputs.input_ids.device, non_blocking=True)
        n = len(dst)
        inputs.input_ids.index_copy_(0, idx[:n], self.tokens.index_select(0, idx[n:]))


class ModelRunner:
    def __init__(self, model: nn.Module, model_config: ModelConfig, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.tp = getattr(model, "tp", SINGLE)  # this rank's shard of a tensor-parallel model
        self.model_config = model_config  # under tensor parallelism: this rank's heads
        self.config = config  # max_num_seqs resolved for the device (Engine, start_tensor_parallel)
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.sampler = Sampler(device, config.seed)
        self.kv: Optional[KVCachePool] = None
        self.graphs = None  # DecodeGraphRunner, set up by setup_decode_graphs()
        self.verify_graphs = None  # the verify steps' DecodeGraphRunner (with speculative decoding)
        self.kv_graphs = None  # a draft model's K/V-only decode graphs (``fill_kv``; draft_runner.py)
        kernels = False
        if device.type == "cuda" and config.triton_kernels:
            from ingot.ops.triton import register_cuda_kernels

            kernels = register_cuda_kernels()  # Triton kernels become the CUDA dispatch of torch.ops.ingot.*
        # batch 1 runs the Triton split-K GEMV with the norm / SiLU-and-mul fused in (faster than
        # cuBLAS there; from 2 rows on cuBLAS is as fast or faster); without kernels, cuBLAS
        self.policy = OpPolicy(skinny_rows=1 if kernels else 0)

    # ------------------------------------------------------------------ KV cache
    def _bytes_per_block(self) -> int:
        """The pool's bytes per block, from the model's cache entry (``ModelConfig.kv_cache_entry``)."""
        c, e = self.model_config, self.model_config.kv_cache_entry
        return KVCachePool.bytes_per_block(c.num_layers, self.block_size, e.heads, e.head_dim, self.dtype,
                                           e.separate_values)

    def num_kv_blocks(self) -> int:
        """Blocks for the pool: explicit, a token budget on CPU, free memory on CUDA."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type != "cuda":
            return blocks_for(CPU_KV_CACHE_TOKENS, self.block_size) + 1
        peak = self._profile_peak_activation_bytes()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        budget = int(total * self.config.gpu_memory_utilization) - used - peak
        blocks = budget // self._bytes_per_block()
        if blocks < 2:
            raise ConfigError(
                f"no GPU memory left for the KV cache (gpu_memory_utilization={self.config.gpu_memory_utilization}, "
                f"{used / 2**30:.1f} GiB in use); raise it or use a smaller model"
            )
        log.info("weights %.2f GiB as held (quantized ones at their own bytes, scales included); KV cache %d blocks, "
                 "%d tokens, %.2f GiB", self.weight_bytes() / 2**30, blocks, blocks * self.block_size,
                 blocks * self._bytes_per_block() / 2**30)
        return blocks

    def weight_bytes(self) -> int:
        """Bytes of the model's parameters and buffers on this device, each storage once (tied tables)."""
        seen: dict[int, int] = {}
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if t.device == self.device:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    def _profile_peak_activation_bytes(self) -> int:
        """Run one full-size prefill on a scratch cache and measure the activation peak."""
        tokens = self.config.max_num_batched_tokens
        blocks = blocks_for(tokens, self.block_size) + 1
        self.allocate_kv_cache(blocks)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        pos = torch.arange(tokens, device=self.device).clamp(max=self.rotary_len() - 1)
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=torch.arange(tokens, device=self.device) + self.block_size,
            block_tables=torch.arange(1, blocks, dtype=torch.int32, device=self.device)[None],
            seq_lens=torch.tensor([tokens], dtype=torch.int32, device=self.device),
            cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=self.device),
        )
        with torch.inference_mode():
            hidden = self.model(ids, pos, meta, self.policy)
            self.model.compute_logits(hidden[-self.config.max_num_seqs :], self.policy)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.release_kv_cache()
        torch.cuda.empty_cache()
        return peak

    def rotary_len(self) -> int:
        return self.model.layers[0].self_attn.rotary.cos_sin_cache.shape[0]

    def allocate_kv_cache(self, num_blocks: int) -> KVCachePool:
        c, e = self.model_config, self.model_config.kv_cache_entry
        self.kv = KVCachePool(c.num_layers, num_blocks, self.block_size, e.heads, e.head_dim, self.dtype, self.device,
                              e.separate_values)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv.layer(i)
        return self.kv

    def release_kv_cache(self) -> None:
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = None
        self.kv = None

    # ------------------------------------------------------------------ graphs
    def setup_decode_graphs(self, max_blocks_per_seq: int) -> None:
        """Capture decode graphs on CUDA (or the fake padded path when asked), and verify
        graphs with speculative decoding, into one memory pool."""
        from ingot.runner.graph_runner import capture_sets, graphs_enabled

        if graphs_enabled(self.config, self.device):
            capture_sets(self.graph_sets(max_blocks_per_seq))

    def graph_sets(self, max_blocks_per_seq: int) -> list:
        """Build (not capture) this runner's decode graphs and, with speculative decoding, its
        verify graphs."""
        from ingot.runner.graph_runner import DecodeGraphRunner

        args = (self.model, self.config, self.device, max_blocks_per_seq, self.policy, self.tp)
        self.graphs = DecodeGraphRunner(*args)
        if self.config.speculative_config is not None:
            self.verify_graphs = DecodeGraphRunner(*args, store_first=True)
        return [g for g in (self.graphs, self.verify_graphs) if g is not None]

    # ------------------------------------------------------------------ step
    def _graphs_for(self, inputs: StepInputs):
        """The graph set that replays ``inputs`` (decode or verify rows that fit a bucket), or None."""
        graphs = self.verify_graphs if inputs.attn.store_first else self.graphs
        if graphs is not None and not inputs.attn.is_prefill and graphs.fits(inputs.num_seqs):
            return graphs
        return None

    @torch.inference_mode()
    def forward_logits(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [S, vocab] of the rows that sample this step (a verify step: of every row)."""
        graphs = self._graphs_for(inputs)
        return graphs.run(inputs) if graphs is not None else self.raw_logits(inputs)

    @torch.inference_mode()
    def fill_kv(self, inputs: StepInputs) -> None:
        """The forward for its K/V writes alone (a draft model following the target's steps):
        decode rows through the K/V-only graphs, or the graphs ``forward_logits`` would
        replay (their logits unread), else the raw forward without the lm_head."""
        kv, attn = self.kv_graphs, inputs.attn
        if kv is not None and not attn.is_prefill and not attn.store_first and kv.fits(inputs.num_seqs):
            kv.run(inputs)
            return
        graphs = self._graphs_for(inputs)
        if graphs is not None:
            graphs.run(inputs)
        else:
            self._hidden(inputs)

    @torch.inference_mode()
    def raw_logits(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [S, vocab] of the rows that sample, through the raw forward (no graphs)."""
        return self._logits(self._hidden(inputs).index_select(0, inputs.logits_indices))

    def launch(self, batch: ScheduledBatch, eos_token_ids: tuple[int, ...], feed: Optional[TokenFeed] = None) -> "LaunchedStep":
        """Queue one step on the device and start copying its samples to the host; nothing
        here waits for the GPU (except prompt logprobs and a failed sampler's fallback).

        ``feed``: rows whose last token was sampled by a step still in flight read it on
        the device (``TokenFeed``) instead of from the host."""
        inputs = self.stage(batch)
        if feed is not None:
            feed.apply(inputs, batch)
        return self.launch_staged(batch, inputs, eos_token_ids)

    def stage(self, batch: ScheduledBatch) -> StepInputs:
        """The step's inputs on the device."""
        return build_step_inputs(batch, self.block_size, self.device)

    def launch_staged(self, batch: ScheduledBatch, inputs: StepInputs, eos_token_ids: tuple[int, ...]) -> "LaunchedStep":
        """``run_model`` on staged inputs, then the prompt logprobs and the queued sampling.
        A batch with a ``token_mask`` gets its mask once the forward is queued, so the host
        computes it while the device runs the forward."""
        spans = prompt_spans(batch)
        entries = {}

        def on_span(k: int, logits: torch.Tensor) -> None:
            entries[spans[k].row] = span_entries(logits, batch, spans[k])

        logits = self.run_model(inputs, [(s.start, s.stop) for s in spans], on_span)
        prompt_lp = {s.row: entries.get(s.row, []) for s in spans} or None
        if logits is None:
            return LaunchedStep([], ready=SamplerOutput([], [], prompt_logprobs=prompt_lp))
        rows = sampling_rows(batch, inputs.sample_rows, eos_token_ids)
        mask = batch.token_mask(inputs.sample_rows, batch.draft_tokens) if batch.token_mask is not None else None
        if batch.draft_tokens is not None:  # speculative decoding: keep each row's accepted drafts
            verify = verify_drafts(self.sampler, logits, rows, batch.draft_tokens, mask, batch.draft_probs)
            return LaunchedStep(inputs.sample_rows, sample=verify)
        try:
            sample = self.sampler.sample(logits, rows, mask)
        except Exception:  # find the rows that fail, so that they fail alone
            log.exception("sampling a batch of %d rows failed; sampling its rows one by one", len(rows))
            out = self._sample_rows_alone(logits, rows, mask)
            out.prompt_logprobs = prompt_lp
            return LaunchedStep(inputs.sample_rows, ready=out)
        sample.start_copy()
        return LaunchedStep(inputs.sample_rows, sample=sample, prompt_logprobs=prompt_lp)

    @torch.inference_mode()
    def run_model(
        self,
        inputs: StepInputs,
        spans: Sequence[tuple[int, int]] = (),
        on_span: Optional[Callable[[int, torch.Tensor], None]] = None,
    ) -> Optional[torch.Tensor]:
        """The device part of a step: the logits of the rows that sample (None if none does);
        with prompt-logprob ``spans`` (hidden-state rows [start, stop)), each non-empty span's
        logits go to ``on_span(k, logits)`` as they are computed."""
        if spans or not inputs.sample_rows:  # the raw forward's hidden states are needed
            hidden = self._hidden(inputs)
            for k, (start, stop) in enumerate(spans):
                if stop > start:
                    logits = self._logits(hidden[start:stop])
                    if on_span is not None:
                        on_span(k, logits)
            if not inputs.sample_rows:
                return None
            return self._logits(hidden.index_select(0, inputs.logits_indices))
        return self.forward_logits(inputs)

    def _sample_rows_alone(self, logits: torch.Tensor, rows: list[SamplingRow], mask: Optional[TokenMask]) -> SamplerOutput:
        out = SamplerOutput([], [], [])
        for i, row in enumerate(rows):
            try:
                one = self.sampler(logits[i : i + 1], [row], mask.select(i) if mask is not None else None)
                out.token_ids.append(one.token_ids[0])
                out.logprobs.append(one.logprobs[0])
                out.errors.append(None)
            except Exception as exc:
                out.token_ids.append(-1)
                out.logprobs.append(None)
                out.errors.append(f"sampling failed: {type(exc).__name__}: {exc}")
        return out

    @torch.inference_mode()
    def _hidden(self, inputs: StepInputs) -> torch.Tensor:
        """The raw forward's final hidden states [T, hidden] (fills the KV cache)."""
        return self.model(inputs.input_ids, inputs.positions, inputs.attn, self.policy)

    @torch.inference_mode()
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden, self.policy)

    # ------------------------------------------------------------------ executor
    def generator(self, seed: int) -> torch.Generator:
        return make_generator(seed, self.device)

    def make_current(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def run_on_ranks(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(self, *args)``: one process is every rank."""
        return fn(self, *args)

    def close(self) -> None:
        """Release what outlives the engine's memory (a tensor-parallel runner's workers)."""
