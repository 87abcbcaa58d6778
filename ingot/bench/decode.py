"""Decode-step timing for eager, graph and compiled graph on one model, per batch size.

Used by ``ingot bench decode`` (real checkpoints or random-weight model
shapes). Each batch is a synthetic decode step: every sequence has
``context_len`` cached tokens in its own blocks, so attention reads real-sized
context.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Optional

import torch

from ingot.config import EngineConfig
from ingot.runner.kv_pool import blocks_for
from ingot.layers.attention import AttentionMetadata
from ingot.models.loader import build_model, init_random
from ingot.loading.model_config import ModelConfig
from ingot.bench.gemm_floor import gemm_only_ms
from ingot.bench.step_profile import StepProfile, profile_step
from ingot.runner.auto_compile import time_ms
from ingot.runner.graph_runner import DecodeGraphRunner
from ingot.runner.model_runner import ModelRunner
from ingot.runner.step_inputs import StepInputs

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
    ms: dict[str, float] = field(default_factory=dict)  # mode -> median ms per step
    warmup_s: dict[str, float] = field(default_factory=dict)  # mode -> warm-up (compile) seconds
    capture_s: dict[str, float] = field(default_factory=dict)
    auto_choice: Optional[str] = None  # with mode "auto": "compiled" or "graph", and why
    profile: Optional[StepProfile] = None  # kernels of one graph replay, when profiled


def synthetic_decode_inputs(batch: int, context_len: int, block_size: int, device: torch.device, vocab_size: int = 1000) -> StepInputs:
    """Sequence i owns blocks 1 + i*n ... ; each decodes its token at position ``context_len``."""
    n = blocks_for(context_len + 1, block_size)
    tables = torch.arange(1, 1 + batch * n, dtype=torch.int32, device=device).view(batch, n)
    pos = torch.full((batch,), context_len, dtype=torch.int64, device=device)
    slots = tables[:, context_len // block_size].long() * block_size + context_len % block_size
    meta = AttentionMetadata(False, slots, tables, torch.full((batch,), context_len + 1, dtype=torch.int32, device=device))
    ids = torch.randint(0, min(1000, vocab_size), (batch,), device=device)
    return StepInputs(ids, pos, meta, torch.arange(batch, device=device), list(range(batch)))


def time_cuda(fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs, each timed with CUDA events."""
    return statistics.median(time_ms(fn, iters, torch.device("cuda"), warmup))


def build_shape(
    shape: str, dtype: torch.dtype, device: torch.device, max_position: int, vocab_size: Optional[int] = None,
    num_layers: Optional[int] = None,
) -> tuple[torch.nn.Module, ModelConfig]:
    """A random-weight model of ``shape`` (``vocab_size`` replaces the shape's, to match a tokenizer;
    ``num_layers`` keeps that many decoder layers: a reduced model of the same layer shapes)."""
    fields = dict(SHAPES[shape])
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
    cfg = ModelConfig.from_hf(fields)
    model = build_model(cfg, dtype, device, max_position)
    return init_random(model), cfg


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
    base = config.replace(max_num_seqs=max(batches), cudagraph_capture_sizes=tuple(batches), show_progress=False)
    runner = ModelRunner(model, cfg, base, device, dtype)
    per_seq = blocks_for(context_len + 1, base.block_size)
    runner.allocate_kv_cache(1 + max(batches) * per_seq)
    return base, runner, per_seq


def bench_decode(
    model: torch.nn.Module,
    cfg: ModelConfig,
    batches: list[int],
    context_len: int,
    modes: list[str],
    iters: int = 30,
    dtype: torch.dtype = torch.bfloat16,
    config: Optional[EngineConfig] = None,
    profile_steps: int = 0,
) -> list[BucketTiming]:
    """ms per decode step per batch size for each mode: eager, graph, compiled, auto
    (per-bucket choice, see runner/auto_compile.py) and gemm_only (the model's linear
    layers alone, the floor a step cannot beat). ``profile_steps`` > 0: also the
    kernels of the graph mode's replays, per step (``step_profile.py``)."""
    device = next(model.parameters()).device
    base, runner, per_seq = decode_bench_runner(model, cfg, config or EngineConfig(), batches, context_len, dtype)
    inputs = {b: synthetic_decode_inputs(b, context_len, base.block_size, device, cfg.vocab_size) for b in batches}
    results = {b: BucketTiming(b) for b in batches}
    for mode in modes:
        if mode == "gemm_only":
            for b in batches:
                results[b].ms[mode] = gemm_only_ms(model, b, runner.policy, iters)
            continue
        if mode == "eager":
            runner.graphs = None
            for b in batches:
                results[b].ms[mode] = time_cuda(lambda: runner.forward_logits(inputs[b]), iters)
            continue
        cfg_mode = base.replace(decode_compile={"graph": False, "compiled": True, "auto": "auto"}[mode])
        graphs = DecodeGraphRunner(model, cfg_mode, device, per_seq, runner.policy)
        graphs.capture_all()
        for b in batches:
            info = graphs.info[b]
            results[b].warmup_s[mode] = info.seconds_warmup
            results[b].capture_s[mode] = info.seconds_capture
            if b in graphs.decisions:
                d = graphs.decisions[b]
                results[b].auto_choice = f"{'compiled' if d.use_compiled else 'graph'}: {d.reason}"
            with torch.inference_mode():
                results[b].ms[mode] = time_cuda(lambda: graphs.run(inputs[b]), iters)
            if mode == "graph" and profile_steps:
                results[b].profile = profile_step(lambda: graphs.run(inputs[b]), profile_steps)
        del graphs
        torch.cuda.empty_cache()
    return [results[b] for b in batches]
