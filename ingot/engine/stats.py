"""EngineStats: a snapshot of the engine's load and counters, for metrics and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0  # sequences in the running batch
    num_waiting: int = 0  # sequences waiting to be scheduled
    kv_cache_usage: float = 0.0  # fraction of the usable KV blocks held by sequences
    num_preemptions: int = 0  # since start
    prompt_tokens: int = 0  # prompt tokens of the requests admitted, since start
    generation_tokens: int = 0  # tokens sampled, since start
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of those, tokens found cached
    prefill_steps: int = 0  # steps that computed prompt tokens, since start
    decode_steps: int = 0  # one-token-per-sequence steps, since start
    decode_rows: int = 0  # sequences in those steps, summed (their mean batch: decode_rows / decode_steps)
    # speculative decoding (vLLM's names): verify-step drafts, their tokens, and the tokens kept
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0


@dataclass(frozen=True)
class EngineInfo:
    """What a client of an engine (in this process or another) needs to know of it."""

    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    num_kv_blocks: int  # usable blocks (the padding block not counted)
    kv_capacity_tokens: int
