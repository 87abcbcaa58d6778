"""Decode CUDA graphs: buckets, padded static buffers, one shared pool, capture, replay.

Knows nothing about which model or which kernels run: it receives a decode
``forward(input_ids, positions, slot_mapping, block_tables, seq_lens) -> logits``
(raw, or compiled by ``decode_compile``) and replays one graph per batch-size
bucket. Everything that changes per step lives in the static buffers; padded
rows write their K/V to the dummy slot 0 and attend only to it, and their
logits are dropped.

A runner holds one set of graphs: plain decode steps (a row per sequence), or with
``store_first`` speculative decoding's verify steps (a row per position of each
sequence, bucketed by rows: ``verify_buckets``), whose forward stores every row's K/V
before any row attends. ``capture_sets`` captures several sets into one memory pool.

On CPU there are no graphs; ``CPU_BUCKETS`` (a test hook, not a speed-up) runs the
same padded bucket path without them, so the padding and buffer logic is exercised
there.

Under tensor parallelism every rank captures the same buckets in the same
order (the forward's collectives run in lockstep), and ``decode_compile="auto"``
keeps a bucket's compiled graph only if every rank chose it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn
from tqdm.auto import tqdm

from ingot.config import EngineConfig
from ingot.distributed.collectives import min_over_ranks
from ingot.distributed.parallel import SINGLE, TensorParallel
from ingot.layers.attention import AttentionMetadata
from ingot.layers.policy import OpPolicy
from ingot.runner import auto_compile, compile_stats, decode_compile
from ingot.runner.step_inputs import StepInputs

log = logging.getLogger(__name__)

DecodeForward = Callable[..., torch.Tensor]
# Test hook: engines on CPU run decode through padded buckets (no graphs) when set.
CPU_BUCKETS = False


def default_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, every 8 up to 256, then every 32, clipped to max_num_seqs (always
    included): a batch pads by at most 7 rows up to 256 and at most 31 above (a larger
    step's padding costs a smaller share of it)."""
    sizes = [1, 2, 4, 8, *range(16, 257, 8), *range(288, max_num_seqs + 1, 32)]
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


def capture_sizes(config: EngineConfig) -> list[int]:
    """The configured sizes that fit max_num_seqs (max_num_seqs itself if none do)."""
    if config.cudagraph_capture_sizes:
        return sorted({s for s in config.cudagraph_capture_sizes if s <= config.max_num_seqs} or {config.max_num_seqs})
    return default_buckets(config.max_num_seqs)


def verify_buckets(max_rows: int) -> list[int]:
    """Row counts of the verify graphs: 2, 3, 4, 6, 8, 12, 16, 24, ... (each power of two and
    the midpoint 3 * 2^n before the next), clipped to ``max_rows`` (always included): at most
    a third of a bucket's rows are padding, with two graphs per doubling (a verify step has
    up to ``num_speculative_tokens + 1`` times a decode step's rows, and each graph keeps its
    logits in the pool)."""
    sizes = {s for n in range(max_rows.bit_length()) for s in (1 << n, 3 << n) if 2 <= s <= max_rows}
    return sorted(sizes | {max_rows})


def graphs_enabled(config: EngineConfig, device: torch.device) -> bool:
    if config.eager_mode:
        return False
    return device.type == "cuda" or CPU_BUCKETS


def make_decode_forward(model: nn.Module, policy: OpPolicy, store_first: bool = False,
                        logits: bool = True) -> DecodeForward:
    """The decode step as a function of plain tensors (what gets compiled and captured),
    its layers running their fusible ops as ``policy`` says; with ``store_first`` a verify
    step's (``AttentionMetadata.store_first``); without ``logits`` a step run for its K/V
    writes alone (a draft model following the target: no lm_head, the hidden states out).
    They are separate functions, so torch.compile keeps a cache of its own for each
    (Dynamo's caches are per code object)."""

    def logits(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return model.compute_logits(model(input_ids, positions, meta, policy), policy)

    def decode_forward(
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        return logits(input_ids, positions, AttentionMetadata(False, slot_mapping, block_tables, seq_lens))

    def verify_forward(
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        meta = AttentionMetadata(False, slot_mapping, block_tables, seq_lens, store_first=True)
        return logits(input_ids, positions, meta)

    def kv_forward(
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        return model(input_ids, positions, AttentionMetadata(False, slot_mapping, block_tables, seq_lens), policy)

    if not logits:
        assert not store_first, "K/V-only graphs are decode steps"
        return kv_forward
    return verify_forward if store_first else decode_forward


@dataclass
class BucketInfo:
    size: int
    seconds_warmup: float = 0.0  # includes the compile, when on
    seconds_capture: float = 0.0
    compiled: bool = False
    stats: Optional[compile_stats.CompileStats] = None


@dataclass
class StaticBuffers:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, max_blocks: int, device: torch.device) -> "StaticBuffers":
        def z(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            z(rows, dtype=torch.int64),
            z(rows, dtype=torch.int64),
            z(rows, dtype=torch.int64),
            z(rows, max_blocks, dtype=torch.int32),
            torch.ones(rows, dtype=torch.int32, device=device),
        )

    def view(self, n: int) -> tuple[torch.Tensor, ...]:
        return (self.input_ids[:n], self.positions[:n], self.slot_mapping[:n], self.block_tables[:n], self.seq_lens[:n])

    def fill(self, inputs: StepInputs, bucket: int) -> None:
        """Copy a real decode batch in; reset the padded rows to the dummy slot."""
        b = inputs.num_seqs
        a = inputs.attn
        self.input_ids[:b].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:b].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:b].copy_(a.slot_mapping, non_blocking=True)
        self.seq_lens[:b].copy_(a.seq_lens, non_blocking=True)
        width = a.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(a.block_tables, non_blocking=True)
        self.block_tables[:b, width:].zero_()
        if bucket > b:
            self.reset(b, bucket)

    def reset(self, start: int, end: int) -> None:
        """Rows [start, end) become padding: token 0 at position 0, K/V to the dummy slot."""
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slot_mapping[start:end].zero_()
        self.block_tables[start:end].zero_()
        self.seq_lens[start:end].fill_(1)

    def probe(self, n: int, vocab: int) -> None:
        """A fixed probe batch for auto-compile: varied tokens, each alone at position 0 (dummy slot)."""
        self.reset(0, n)
        ids = (torch.arange(n, device=self.input_ids.device) * 7919 + 13) % vocab
        self.input_ids[:n].copy_(ids)


@dataclass
class CapturedBucket:
    """One bucket's forward and, on CUDA, its graph and the graph's output buffer."""

    forward: DecodeForward
    compiled: bool
    graph: Optional[torch.cuda.CUDAGraph] = None
    output: Optional[torch.Tensor] = None

    def replay(self, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.graph is None:  # fake capture: run the forward on the padded buffers
            return self.forward(*args)
        self.graph.replay()
        return self.output


class DecodeGraphRunner:
    """One set of graphs: decode steps, or with ``store_first`` verify steps (buckets of
    rows: ``verify_buckets(config.max_verify_rows)``), or without ``logits`` decode steps run
    for their K/V alone (their output: the hidden states). ``buckets``: other sizes
    (benchmarks, a draft model); ``pool``: a memory pool to capture into (``capture_sets``)."""

    def __init__(
        self, model: nn.Module, config: EngineConfig, device: torch.device, max_blocks_per_seq: int, policy: OpPolicy,
        tp: TensorParallel = SINGLE, store_first: bool = False, buckets: Optional[list[int]] = None, pool=None,
        logits: bool = True,
    ) -> None:
        self.model = model
        self.policy = policy
        self.tp = tp
        self.config = config
        self.device = device
        self.fake = device.type != "cuda"
        self.auto = config.decode_compile == "auto"
        self.store_first = store_first
        self.logits = logits
        if buckets is None:
            buckets = verify_buckets(config.max_verify_rows) if store_first else capture_sizes(config)
        self.buckets = sorted(set(buckets))
        self.max_blocks = max_blocks_per_seq
        self.buffers = StaticBuffers.allocate(self.buckets[-1], max_blocks_per_seq, device)
        self.raw_forward = make_decode_forward(model, policy, store_first, logits)
        self._forward: Optional[DecodeForward] = None  # built lazily at the first capture
        self.entries: dict[int, CapturedBucket] = {}
        self.info: dict[int, BucketInfo] = {}
        self.decisions: dict[int, auto_compile.BucketDecision] = {}
        self.pool = pool

    # ------------------------------------------------------------------ build
    @property
    def forward(self) -> DecodeForward:
        """The compiled forward if compile is on (built once, lazily), else the raw one.

        The compiled one runs the ``compile_native_ops`` in their PyTorch form, for Inductor to fuse."""
        if self._forward is None:
            native = make_decode_forward(self.model, self.policy.with_native(self.config.compile_native_ops), self.store_first,
                                         self.logits)
            compiled = decode_compile.build_decode_forward(native, self.config, self.device)
            self._forward = compiled if getattr(compiled, "compiled", False) else self.raw_forward
        return self._forward

    @property
    def compiled(self) -> bool:
        """Whether any bucket replays the compiled forward."""
        return any(e.compiled for e in self.entries.values())

    def bucket_for(self, batch: int) -> Optional[int]:
        for size in self.buckets:
            if size >= batch:
                return size
        return None

    def fits(self, batch: int) -> bool:
        return batch <= self.buckets[-1]

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Warm up and capture every bucket, largest first (smaller ones reuse its pool)."""
        kind = "verify" if self.store_first else "decode" if self.logits else "K/V-only decode"
        bar = tqdm(sorted(self.buckets, reverse=True), desc=f"Capturing {kind} graphs", unit=" bucket",
                   disable=not self.config.show_progress)
        for size in bar:
            info = self.capture(size)
            bar.set_postfix_str(f"{'rows' if self.store_first else 'bs'}={size} warmup {info.seconds_warmup:.1f}s "
                                f"capture {info.seconds_capture:.2f}s")
        bar.close()
        total = sum(i.seconds_warmup + i.seconds_capture for i in self.info.values())
        log.info("%s graphs ready: %d buckets in %.1fs (compiled: %s)", kind, len(self.info), total,
                 sorted(s for s, e in self.entries.items() if e.compiled) or "none")
        if self.decisions:
            log.info("decode_compile=auto, per bucket:\n%s", auto_compile.decision_table(list(self.decisions.values())))

    @torch.inference_mode()
    def capture(self, size: int) -> BucketInfo:
        info = BucketInfo(size)
        forward = self.forward
        is_compiled = bool(getattr(forward, "compiled", False))
        if self.auto and is_compiled:
            raw = self._warm_and_capture(self.raw_forward, False, size, info)
            comp = self._warm_and_capture(forward, True, size, info)
            decision = self._decide(size, raw, comp)
            every_rank = bool(min_over_ranks(int(decision.use_compiled), self.tp, self.device))
            if decision.use_compiled and not every_rank:
                decision = dataclasses.replace(decision, use_compiled=False, reason=f"another rank chose graph; {decision.reason}")
            self.decisions[size] = decision
            self.entries[size] = comp if decision.use_compiled else raw
        else:
            self.entries[size] = self._warm_and_capture(forward, is_compiled, size, info)
        info.compiled = self.entries[size].compiled
        self.info[size] = info
        return info

    def _warm_and_capture(self, forward: DecodeForward, compiled: bool, size: int, info: BucketInfo) -> CapturedBucket:
        """Warm up (compiling, when on, and autotuning kernels), then capture one graph.

        Fake capture (no graphs: CPU tests) warms up only a compiled forward: a raw one has
        nothing to warm, and running every bucket up to 256 rows on a CPU takes minutes."""
        args = self.buffers.view(size)
        snap = compile_stats.stats_snapshot()
        t0 = time.perf_counter()
        for _ in range(2 if compiled or not self.fake else 0):
            forward(*args)
        self._sync()
        info.seconds_warmup += time.perf_counter() - t0
        if compiled:
            info.stats = compile_stats.stats_since(snap)
            if info.stats is not None and (info.stats.graph_breaks or info.stats.recompiles):
                log.info("bucket %d: %s", size, info.stats.describe())
        entry = CapturedBucket(forward, compiled)
        if self.fake:
            return entry
        t0 = time.perf_counter()
        entry.graph = torch.cuda.CUDAGraph()
        with decode_compile.forbid_recompiles() if compiled else contextlib.nullcontext():
            with torch.cuda.graph(entry.graph, pool=self.pool):
                entry.output = forward(*args)
        if self.pool is None:
            self.pool = entry.graph.pool()
        self._sync()
        info.seconds_capture += time.perf_counter() - t0
        return entry

    def _decide(self, size: int, raw: CapturedBucket, comp: CapturedBucket, rounds: int = 5, iters: int = 6) -> auto_compile.BucketDecision:
        """Probe drift and interleaved replay timings of both graphs of a bucket."""
        args = self.buffers.view(size)
        vocab = raw.replay(args).shape[-1]  # learnt from the output: the runner knows no model
        self.buffers.probe(size, vocab)
        out_raw = raw.replay(args).float().clone()
        out_comp = comp.replay(args).float().clone()
        drift = auto_compile.ProbeDrift.measure(out_comp, out_raw)
        t_raw: list[float] = []
        t_comp: list[float] = []
        for _ in range(rounds):  # interleaved, so drifting clocks hit both alike
            t_raw += auto_compile.time_ms(lambda: raw.replay(args), iters, self.device, warmup=1)
            t_comp += auto_compile.time_ms(lambda: comp.replay(args), iters, self.device, warmup=1)
        self.buffers.reset(0, size)
        return auto_compile.decide(size, t_raw, t_comp, drift)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ replay
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Logits (K/V-only graphs: hidden states) of the real rows of a decode batch (of this
        set's kind) that fits a bucket."""
        assert inputs.attn.store_first == self.store_first and not inputs.attn.is_prefill
        b = inputs.num_seqs
        bucket = self.bucket_for(b)
        assert bucket is not None, "caller checks fits()"
        self.buffers.fill(inputs, bucket)
        return self.entries[bucket].replay(self.buffers.view(bucket))[:b]


def capture_sets(runners: list[DecodeGraphRunner]) -> None:
    """Capture every runner's graphs into one memory pool, the runner with the largest
    bucket first (smaller graphs then fit the pool it made); one step replays at a time,
    so graphs of both kinds can share it."""
    pool = None
    for runner in sorted(runners, key=lambda r: r.buckets[-1], reverse=True):
        runner.pool = runner.pool if pool is None else pool
        runner.capture_all()
        pool = runner.pool
