"""Decode-step timing for eager, graph and compiled graph on one model, per batch size.

Used by ``ingot bench decode`` (real checkpoints or random-weight model
shapes). Each batch is a synthetic decode step: every sequence has
``context_len`` cached tokens in its own blocks, so attention reads real-sized
context. With draft counts (``--speculative-k``) each mode's graphs are also
timed against verify steps of the same sequences (``decode_spec.py``). The
model comes from an ``Engine`` built for it (``decode_engine``), and the timing
runs on its ModelRunner through ``Executor.run_on_ranks`` (``bench_decode``):
under tensor parallelism every rank times the same graph replays in lockstep,
their collectives inside.
"""

from __future__ import annotations

import array
import statistics
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ingot.bench.decode_spec import VerifyTiming, time_verify_steps
from ingot.bench.floor import ModelBytes
from ingot.bench.gemm_floor import gemm_only_ms
from ingot.bench.gpu_state import gpu_state
from ingot.bench.step_profile import StepProfile, profile_step
from ingot.config import EngineConfig, SpeculativeConfig
from ingot.engine.engine import Engine
from ingot.layers.fused_moe import FusedMoE
from ingot.runner.auto_compile import time_ms
from ingot.runner.batch import ScheduledBatch
from ingot.runner.graph_runner import DecodeGraphRunner
from ingot.runner.kv_pool import blocks_for
from ingot.runner.model_runner import ModelRunner
from ingot.runner.step_inputs import StepInputs
from ingot.sampling_params import SamplingParams

@dataclass
class BucketTiming:
    batch: int
    ms: dict[str, float] = field(default_factory=dict)  # mode -> median ms per step, each step timed alone
    back_to_back_ms: dict[str, float] = field(default_factory=dict)  # mode -> ms per step, steps queued back to back
    warmup_s: dict[str, float] = field(default_factory=dict)  # mode -> warm-up (compile) seconds
    capture_s: dict[str, float] = field(default_factory=dict)
    auto_choice: Optional[str] = None  # with mode "auto": "compiled" or "graph", and why
    profiles: dict[str, StepProfile] = field(default_factory=dict)  # mode -> kernels of one replay, when profiled
    gpu_state: dict[str, dict] = field(default_factory=dict)  # mode -> clocks, power, limits after its timing (NVML)
    experts_hit: Optional[list[int]] = None  # distinct experts each sparse layer's routing picks for the step
    speculative: dict[str, list[VerifyTiming]] = field(default_factory=dict)  # mode -> per draft count


@dataclass
class SyntheticSeq:
    """A sequence of a synthetic decode step (the fields ``ScheduledBatch`` reads)."""

    prompt_token_ids: list[int]
    block_ids: array.array
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    params: SamplingParams = field(default_factory=SamplingParams)
    generator: Optional[torch.Generator] = None
    draft_kv_len: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        return (self.prompt_token_ids + self.output_token_ids)[start:end]


def synthetic_decode_batch(batch: int, context_len: int, block_size: int, vocab_size: int = 1000, seed: int = 0,
                           drafts: int = 0) -> ScheduledBatch:
    """Sequence i owns blocks 1 + i*n ... ; each decodes its token at position ``context_len``
    (with blocks for ``drafts`` tokens more: a verify step's)."""
    n = blocks_for(context_len + 1 + drafts, block_size)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, min(1000, vocab_size), (batch,), generator=gen).tolist()
    seqs = [
        SyntheticSeq([0] * context_len + [ids[i]], array.array("i", range(1 + i * n, 1 + (i + 1) * n)), context_len)
        for i in range(batch)
    ]
    return ScheduledBatch(seqs, is_prefill=False, num_new_tokens=[1] * batch)


def time_cuda(fn, iters: int, device: torch.device, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs, each timed with CUDA events (on CPU:
    the wall clock)."""
    return statistics.median(time_ms(fn, iters, device, warmup))


def time_back_to_back(fn, steps: int, device: torch.device, repeats: int = 5) -> float:
    """Milliseconds per call of ``fn`` with ``steps`` calls queued back to back (median of ``repeats``).

    ``time_cuda`` times each call alone: the device idles while the host copies the
    step's inputs and launches its graph. Queued, the host issues a step while the
    device runs the one before, as the engine's overlap scheduling lets it, so this is
    the device's time per step (on CPU the two are the same thing).
    """
    def queued() -> None:
        for _ in range(steps):
            fn()

    return statistics.median(time_ms(queued, repeats, device, warmup=1)) / steps


def decode_engine(config: EngineConfig, batches: list[int], context_len: int, drafts: int = 0) -> Engine:
    """An engine over ``config``'s model for synthetic decode steps: no graphs of its own (the
    benchmark captures its own per mode), a KV pool where each of ``max(batches)`` sequences
    owns the blocks of ``context_len + 1 + drafts`` tokens, no step larger than the largest
    batch, or its verify step with ``drafts`` per sequence (which size a tensor-parallel step
    buffer)."""
    tokens = context_len + 1 + drafts
    per_seq = blocks_for(tokens, config.block_size)
    spec = SpeculativeConfig("ngram", drafts, disable_by_batch_size=max(batches)) if drafts else None
    return Engine(config.replace(
        max_model_len=tokens, num_kv_blocks=1 + max(batches) * per_seq, max_num_seqs=max(batches),
        max_num_batched_tokens=max(batches), cudagraph_capture_sizes=tuple(batches), eager_mode=True,
        speculative_config=spec, show_progress=False))


def dtype_of(runner: ModelRunner) -> torch.dtype:
    """The dtype a rank's model runs in (``Executor.run_on_ranks(dtype_of)``)."""
    return runner.dtype


def count_experts_hit(runner: ModelRunner, inputs: StepInputs) -> Optional[list[int]]:
    """Distinct experts each sparse layer's routing picks for the staged step ``inputs`` (one
    eager forward, its expert ids read by hooks on the fused-MoE layers); None for dense models."""
    layers = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    if not layers:
        return None
    ids: dict[FusedMoE, torch.Tensor] = {}

    def keep(mod: FusedMoE, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        ids[mod] = args[2] if len(args) > 2 else kwargs["topk_ids"]

    hooks = [m.register_forward_hook(keep, with_kwargs=True) for m in layers]
    try:
        runner.raw_logits(inputs)
    finally:
        for h in hooks:
            h.remove()
    return [int(torch.unique(ids[m]).numel()) for m in layers]


def bench_decode(
    runner: ModelRunner,
    batches: list[int],
    context_len: int,
    modes: list[str],
    iters: int = 30,
    profile_steps: int = 0,
    speculative_ks: Sequence[int] = (),
) -> tuple[list[BucketTiming], ModelBytes]:
    """ms per decode step per batch size for each mode: eager, graph, compiled, auto
    (per-bucket choice, see runner/auto_compile.py) and gemm_only (the model's linear
    layers alone, the floor a step cannot beat), and the bytes a step must read. Runs on a
    rank's ModelRunner (``Executor.run_on_ranks``) of a ``decode_engine``. ``profile_steps``
    > 0: also the kernels of the graph and compiled modes' replays, per step
    (``step_profile.py``). A MoE model's rows also count the experts each sparse layer's
    routing hits (``count_experts_hit``), which the floor then reads instead of the
    uniform-routing expectation. ``speculative_ks``: also time verify steps of that many drafts
    per sequence against the graph and compiled modes' decode steps (``decode_spec.py``; the
    engine from ``decode_engine`` with ``drafts=max(speculative_ks)``)."""
    cfg = runner.model_config
    base = runner.config.replace(eager_mode=False)
    drafts = max(speculative_ks, default=0)
    per_seq = blocks_for(context_len + 1 + drafts, base.block_size)
    batch_of = {b: synthetic_decode_batch(b, context_len, base.block_size, cfg.vocab_size, drafts=drafts) for b in batches}
    inputs_of = {b: runner.stage(batch_of[b]) for b in batches}
    results = {b: BucketTiming(b) for b in batches}
    if cfg.num_experts:  # timed replays route these same tokens: count once
        for b in batches:
            results[b].experts_hit = count_experts_hit(runner, inputs_of[b])
    for mode in modes:
        if mode == "gemm_only":
            for b in batches:
                results[b].ms[mode] = gemm_only_ms(runner.model, b, runner.policy, iters)
            continue
        graphs = None
        if mode != "eager":
            cfg_mode = base.replace(decode_compile={"graph": False, "compiled": True, "auto": "auto"}[mode])
            graphs = DecodeGraphRunner(runner.model, cfg_mode, runner.device, per_seq, runner.policy, runner.tp)
            graphs.capture_all()
        for b in batches:
            if graphs is not None:
                info = graphs.info[b]
                results[b].warmup_s[mode] = info.seconds_warmup
                results[b].capture_s[mode] = info.seconds_capture
                if b in graphs.decisions:
                    d = graphs.decisions[b]
                    results[b].auto_choice = f"{'compiled' if d.use_compiled else 'graph'}: {d.reason}"
            inputs = inputs_of[b]
            step = (lambda: graphs.run(inputs)) if graphs is not None else (lambda: runner.raw_logits(inputs))
            results[b].ms[mode] = time_cuda(step, iters, runner.device)
            results[b].back_to_back_ms[mode] = time_back_to_back(step, iters, runner.device)
            state = gpu_state(runner.device)
            if state is not None:
                results[b].gpu_state[mode] = state
            if mode in ("graph", "compiled") and profile_steps:
                results[b].profiles[mode] = profile_step(step, profile_steps, cfg.num_layers)
        if graphs is not None and mode in ("graph", "compiled") and speculative_ks:
            for b, timings in time_verify_steps(runner, graphs, batch_of, list(speculative_ks), iters, time_cuda).items():
                results[b].speculative[mode] = timings
        del graphs
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()
    return [results[b] for b in batches], ModelBytes.of(runner.model, cfg, runner.dtype)
