"""Decode-step timing for eager, graph and compiled graph on one model, per batch size.

Used by ``ingot bench decode`` (real checkpoints or random-weight model
shapes). Each batch is a synthetic decode step: every sequence has
``context_len`` cached tokens in its own blocks, so attention reads real-sized
context.
"""

from __future__ import annotations

import array
import statistics
from dataclasses import dataclass, field
from typing import Optional

import torch

from ingot.config import EngineConfig
from ingot.runner.kv_pool import blocks_for
from ingot.layers.fused_moe import FusedMoE
from ingot.models.loader import build_model, init_random
from ingot.loading.model_config import ModelConfig
from ingot.bench.gemm_floor import gemm_only_ms
from ingot.bench.gpu_state import gpu_state
from ingot.bench.step_profile import StepProfile, profile_step
from ingot.runner.auto_compile import time_ms
from ingot.runner.batch import ScheduledBatch
from ingot.runner.model_runner import ModelRunner
from ingot.runner.model_source import ModelSource
from ingot.runner.tp_runner import TensorParallelRunner, start_tensor_parallel
from ingot.sampling_params import SamplingParams

# HF config.json fields of the benchmark shapes (random weights).
DEFAULT_SHAPE = "qwen2.5-1.5b"
SHAPES: dict[str, dict] = {
    "qwen2.5-1.5b": dict(architectures=["Qwen2ForCausalLM"], hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen2.5-7b": dict(architectures=["Qwen2ForCausalLM"], hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
    "llama-3-8b": dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
    # mixture of experts (random router weights route about uniformly)
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          tie_word_embeddings=False),
    "qwen1.5-moe-a2.7b": dict(architectures=["Qwen2MoeForCausalLM"], hidden_size=2048, intermediate_size=5632,
                              num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, num_experts=60,
                              num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                              norm_topk_prob=False, decoder_sparse_step=1, vocab_size=151936, max_position_embeddings=8192,
                              rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
    "mixtral-8x7b": dict(architectures=["MixtralForCausalLM"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                         vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
                         tie_word_embeddings=False),
}


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


@dataclass
class SyntheticSeq:
    """A sequence of a synthetic decode step (the fields ``ScheduledBatch`` reads)."""

    prompt_token_ids: list[int]
    block_ids: array.array
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    params: SamplingParams = field(default_factory=SamplingParams)
    generator: Optional[torch.Generator] = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        return (self.prompt_token_ids + self.output_token_ids)[start:end]


def synthetic_decode_batch(batch: int, context_len: int, block_size: int, vocab_size: int = 1000, seed: int = 0) -> ScheduledBatch:
    """Sequence i owns blocks 1 + i*n ... ; each decodes its token at position ``context_len``."""
    n = blocks_for(context_len + 1, block_size)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, min(1000, vocab_size), (batch,), generator=gen).tolist()
    seqs = [
        SyntheticSeq([0] * context_len + [ids[i]], array.array("i", range(1 + i * n, 1 + (i + 1) * n)), context_len)
        for i in range(batch)
    ]
    return ScheduledBatch(seqs, is_prefill=False, num_new_tokens=[1] * batch)


def time_cuda(fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs, each timed with CUDA events."""
    return statistics.median(time_ms(fn, iters, torch.device("cuda"), warmup))


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


def shape_config(shape: str, vocab_size: Optional[int] = None, num_layers: Optional[int] = None) -> dict:
    """The HF config fields of ``shape``, with the vocabulary size or layer count replaced when given."""
    fields = dict(SHAPES[shape])
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
    return fields


def build_shape(
    shape: str, dtype: torch.dtype, device: torch.device, max_position: int, vocab_size: Optional[int] = None,
    num_layers: Optional[int] = None,
) -> tuple[torch.nn.Module, ModelConfig]:
    """A random-weight model of ``shape`` (``vocab_size`` replaces the shape's, to match a tokenizer;
    ``num_layers`` keeps that many decoder layers: a reduced model of the same layer shapes)."""
    cfg = ModelConfig.from_hf(shape_config(shape, vocab_size, num_layers))
    model = build_model(cfg, dtype, device, max_position)
    return init_random(model), cfg


def decode_bench_config(config: EngineConfig, batches: list[int]) -> EngineConfig:
    """The engine configuration of synthetic decode steps: buckets = ``batches``; no step
    has more tokens than the largest batch (which sizes a tensor-parallel step buffer)."""
    return config.replace(max_num_seqs=max(batches), max_num_batched_tokens=max(batches),
                          cudagraph_capture_sizes=tuple(batches), show_progress=False)


def decode_bench_runner(
    model: torch.nn.Module,
    cfg: ModelConfig,
    config: EngineConfig,
    batches: list[int],
    context_len: int,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[EngineConfig, ModelRunner, int]:
    """(config, runner, blocks per sequence) for synthetic decode steps: buckets = ``batches``,
    a KV pool where each of ``max(batches)`` sequences owns the blocks of ``context_len + 1`` tokens."""
    device = next(model.parameters()).device
    base = decode_bench_config(config, batches)
    runner = ModelRunner(model, cfg, base, device, dtype)
    per_seq = blocks_for(context_len + 1, base.block_size)
    runner.allocate_kv_cache(1 + max(batches) * per_seq)
    return base, runner, per_seq


def tp_decode_bench_runner(
    source: ModelSource,
    cfg: ModelConfig,
    config: EngineConfig,
    batches: list[int],
    context_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[EngineConfig, TensorParallelRunner, int]:
    """``decode_bench_runner`` over ``config.tensor_parallel_size`` ranks, each building its
    shard from ``source`` (call ``close()`` on the runner when done)."""
    base = decode_bench_config(config, batches)
    runner = start_tensor_parallel(base, source, cfg, device, dtype, context_len + 64)
    per_seq = blocks_for(context_len + 1, base.block_size)
    runner.allocate_kv_cache(1 + max(batches) * per_seq)
    return base, runner, per_seq


def count_experts_hit(runner: ModelRunner, inputs) -> Optional[list[int]]:
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
        runner.logits_of(None, inputs)
    finally:
        for h in hooks:
            h.remove()
    return [int(torch.unique(ids[m]).numel()) for m in layers]


def bench_decode(
    runner: ModelRunner | TensorParallelRunner,
    base: EngineConfig,
    per_seq: int,
    cfg: ModelConfig,
    batches: list[int],
    context_len: int,
    modes: list[str],
    iters: int = 30,
    profile_steps: int = 0,
) -> list[BucketTiming]:
    """ms per decode step per batch size for each mode: eager, graph, compiled, auto
    (per-bucket choice, see runner/auto_compile.py) and gemm_only (the model's linear
    layers alone, the floor a step cannot beat). ``profile_steps`` > 0: also the
    kernels of the graph and compiled modes' replays, per step (``step_profile.py``). The runner
    comes from ``decode_bench_runner`` or, tensor-parallel (no gemm_only, no profile:
    they time the driver's kernels alone), ``tp_decode_bench_runner``; each timed step
    there includes the broadcast of its inputs to the workers. On one GPU, a MoE model's
    rows also count the experts each sparse layer's routing hits (``count_experts_hit``),
    which the floor then reads instead of the uniform-routing expectation."""
    batch_of = {b: synthetic_decode_batch(b, context_len, base.block_size, cfg.vocab_size) for b in batches}
    results = {b: BucketTiming(b) for b in batches}
    if cfg.num_experts and isinstance(runner, ModelRunner):  # timed replays route these same tokens: count once
        for b in batches:
            results[b].experts_hit = count_experts_hit(runner, runner.stage(batch_of[b]))
    for mode in modes:
        if mode == "gemm_only":
            for b in batches:
                results[b].ms[mode] = gemm_only_ms(runner.model, b, runner.policy, iters)
            continue
        graphs = None
        if mode != "eager":
            cfg_mode = base.replace(decode_compile={"graph": False, "compiled": True, "auto": "auto"}[mode])
            graphs = runner.decode_variant(cfg_mode, per_seq)
        for b in batches:
            if graphs is not None:
                info = graphs.info[b]
                results[b].warmup_s[mode] = info.seconds_warmup
                results[b].capture_s[mode] = info.seconds_capture
                if b in graphs.decisions:
                    d = graphs.decisions[b]
                    results[b].auto_choice = f"{'compiled' if d.use_compiled else 'graph'}: {d.reason}"
            inputs = runner.stage(batch_of[b])
            results[b].ms[mode] = time_cuda(lambda: runner.logits_of(graphs, inputs), iters)
            results[b].back_to_back_ms[mode] = time_back_to_back(lambda: runner.logits_of(graphs, inputs), iters, runner.device)
            state = gpu_state(runner.device)
            if state is not None:
                results[b].gpu_state[mode] = state
            if mode in ("graph", "compiled") and profile_steps:
                results[b].profiles[mode] = profile_step(lambda: runner.logits_of(graphs, inputs), profile_steps,
                                                         cfg.num_layers)
        if graphs is not None:
            runner.drop_variant(graphs)
            del graphs
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()
    return [results[b] for b in batches]
