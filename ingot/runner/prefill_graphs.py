"""Prefill CUDA graphs: one sequence's new tokens, padded up to a bucket of token counts.

An eager forward is launch-bound below a few hundred tokens: the host issues every kernel
of every layer, so a short prompt's prefill costs about what an eager decode step does (tens
of milliseconds), ten times its graph's replay. At low load that host time is most of a
request's time to first token, and the same again for every request a batch-1 server
runs. A prefill step of one sequence (no prompt logprobs, a row that samples) with at most
``PREFILL_GRAPH_MAX_TOKENS`` new tokens therefore replays a graph captured for the next
bucket of token counts.

The padding tokens follow the real ones inside the same sequence: causal attention never
shows a real token a later one, so the real rows compute what the eager forward computes
(up to the kernels' launch choices for the padded row count). The padding writes its K/V to
the dummy slot 0, sits at position 0 for rotary, and its hidden states are never read; the
block table has ``extra_blocks`` zero columns (the dummy block) past the widest real row,
so the padding's positions past a full table still read memory the pool owns. The graph
computes the logits of the sampled row only.

No compile (decode-only); tensor-parallel ranks capture and replay the same buckets, as
they do the decode graphs. On CPU there are no graphs; ``graph_runner.CPU_BUCKETS`` runs
the same padded path without them (tests).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch
from torch import nn
from tqdm.auto import tqdm

from ingot.config import EngineConfig
from ingot.layers.attention import AttentionMetadata
from ingot.layers.policy import OpPolicy
from ingot.runner.step_inputs import StepInputs

log = logging.getLogger(__name__)

# The largest bucket: from about this many tokens on a prefill's kernels outlast its launches
PREFILL_GRAPH_MAX_TOKENS = 512
PREFILL_GRAPH_MIN_TOKENS = 8


def prefill_buckets(max_tokens: int, min_tokens: int = PREFILL_GRAPH_MIN_TOKENS) -> list[int]:
    """Token counts 8, 12, 16, 24, 32, ... (each power of two and the midpoint 3 * 2^n before
    the next), clipped to ``max_tokens`` (always included): at most a third of a replay's
    tokens are padding."""
    sizes = {s for n in range(max_tokens.bit_length()) for s in (1 << n, 3 << n) if min_tokens <= s <= max_tokens}
    return sorted(sizes | {max_tokens})


class PrefillGraphRunner:
    """Graphs of one-sequence prefill steps, a bucket of token counts each; replays return
    the sampled row's logits [1, vocab]."""

    def __init__(self, model: nn.Module, config: EngineConfig, device: torch.device, max_blocks_per_seq: int,
                 policy: OpPolicy, pool=None) -> None:
        self.model = model
        self.policy = policy
        self.config = config
        self.device = device
        self.fake = device.type != "cuda"
        self.buckets = prefill_buckets(min(PREFILL_GRAPH_MAX_TOKENS, config.max_num_batched_tokens))
        top = self.buckets[-1]
        self.extra_blocks = -(-top // config.block_size)
        self.width = max_blocks_per_seq + self.extra_blocks

        def z(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids, self.positions, self.slots = z(top), z(top), z(top)
        self.block_table = z(1, self.width, dtype=torch.int32)
        self.seq_lens = z(1, dtype=torch.int32)
        self.cu_seqlens = z(2, dtype=torch.int32)
        self.logits_index = z(1)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = pool

    def forward(self, tokens: int) -> torch.Tensor:
        """The padded step of ``tokens`` rows on the static buffers: the sampled row's logits."""
        meta = AttentionMetadata(True, self.slots[:tokens], self.block_table, self.seq_lens, self.cu_seqlens)
        hidden = self.model(self.input_ids[:tokens], self.positions[:tokens], meta, self.policy)
        return self.model.compute_logits(hidden.index_select(0, self.logits_index), self.policy)

    def bucket_for(self, tokens: int) -> Optional[int]:
        return next((s for s in self.buckets if s >= tokens), None)

    def fits(self, inputs: StepInputs) -> bool:
        """A prefill of one sequence whose one sampled row is its last, within the largest bucket."""
        a = inputs.attn
        return (a.is_prefill and inputs.num_seqs == 1 and len(inputs.sample_rows) == 1
                and inputs.input_ids.shape[0] <= self.buckets[-1] and a.block_tables.shape[1] <= self.width - self.extra_blocks)

    def fill(self, inputs: StepInputs, bucket: int) -> None:
        """Copy the step in; its padding (rows past its tokens) to position 0 and the dummy slot."""
        n = inputs.input_ids.shape[0]
        a = inputs.attn
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slots[:n].copy_(a.slot_mapping, non_blocking=True)
        if bucket > n:
            self.input_ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            self.slots[n:bucket].zero_()
        width = a.block_tables.shape[1]
        self.block_table[:, :width].copy_(a.block_tables, non_blocking=True)
        self.block_table[:, width:].zero_()
        torch.add(a.seq_lens, bucket - n, out=self.seq_lens)  # the padding extends the sequence
        self.cu_seqlens[1].fill_(bucket)
        self.logits_index.copy_(inputs.logits_indices, non_blocking=True)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The logits [1, vocab] of a step that ``fits``."""
        bucket = self.bucket_for(inputs.input_ids.shape[0])
        assert bucket is not None, "caller checks fits()"
        self.fill(inputs, bucket)
        if self.fake:
            return self.forward(bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket]

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Warm up and capture every bucket, largest first (smaller ones reuse its pool)."""
        if self.fake:
            return
        t0 = time.perf_counter()
        bar = tqdm(sorted(self.buckets, reverse=True), desc="Capturing prefill graphs", unit=" bucket",
                   disable=not self.config.show_progress)
        for size in bar:
            self.cu_seqlens[1].fill_(size)
            self.seq_lens.fill_(size)
            for _ in range(2):  # warm-up: kernels compiled and autotuned, cuDNN plans built
                self.forward(size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = self.forward(size)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        bar.close()
        torch.cuda.synchronize(self.device)
        log.info("prefill graphs ready: %d buckets (%d-%d tokens) in %.1fs", len(self.buckets), self.buckets[0],
                 self.buckets[-1], time.perf_counter() - t0)
