"""Tensor parallelism on CPU (gloo, real worker processes): logits and sampled tokens equal TP1's."""

from __future__ import annotations

import pytest
import torch

from ingot import LLM, SamplingParams
from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from tests.distributed.tp_helpers import alive, teacher_forced_logits, tp_engine
from tests.helpers import write_tiny_checkpoint

# Per architecture, what the split has to handle besides heads and MLP features.
CASES = {
    "llama": {"num_key_value_heads": 1, "vocab_size": 385},  # one KV head replicated on both ranks; padded vocabulary
    "qwen2": {"vocab_size": 385},  # qkv bias; tied embeddings: the lm_head shares the padded vocabulary slice
    "qwen3": {},  # q/k norm, head_dim 32 != hidden / heads
    # experts split by their intermediate features, one all-reduce per MoE block; a dense layer among them
    "qwen3_moe": {},
    "qwen2_moe": {},  # + the gated shared expert, reduced together with the routed ones
    "mixtral": {},  # Mixtral's tensor names; transformers' fused [E, 2I, H] gate_up, cut in two per rank
}
FUSED_EXPERTS = {"mixtral"}
PROMPTS = [list(range(3, 40)), [7, 8, 9], list(range(50, 71))]
ENGINE = dict(max_num_batched_tokens=16, max_model_len=128, max_num_seqs=4)  # chunked prefill: 16 tokens per step


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


@pytest.mark.parametrize("arch", sorted(CASES))
def test_tp2_logits_equal_tp1(tmp_path, arch):
    path = str(write_tiny_checkpoint(tmp_path / arch, arch, fused_experts=arch in FUSED_EXPERTS, overrides=CASES[arch]))
    ref_engine = Engine(EngineConfig.create(model=path, device="cpu", dtype="float32", show_progress=False, **ENGINE))
    ref, fed = teacher_forced_logits(ref_engine, PROMPTS, steps=6)
    engine = tp_engine(path, tensor_parallel_size=2, **ENGINE)
    try:
        got, _ = teacher_forced_logits(engine, PROMPTS, steps=6, forced=fed)
    finally:
        engine.close()
    assert len(got) == len(ref) and sum(r.shape[0] for r in ref) == len(PROMPTS) * 6
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        if r.numel():
            assert _rel_err(g, r) < 1e-5


def test_tp2_sampling_and_logprobs_equal_tp1(tmp_path, monkeypatch):
    """Through LLM: seeded sampling on the driver, sampled and prompt logprobs (the prompt-logprob
    spans run on every rank), chunked prefill; the worker runs with NVLink multicast off and is
    gone after shutdown."""
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):
        monkeypatch.delenv(name, raising=False)
    path = str(write_tiny_checkpoint(tmp_path / "qwen2", "qwen2"))
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, logprobs=2, prompt_logprobs=2)
    results = {}
    for size in (1, 2):
        with LLM(path, device="cpu", dtype="float32", show_progress=False, tensor_parallel_size=size, **ENGINE) as llm:
            results[size] = llm.generate([list(range(3, 30)), [5, 6, 7]], params, use_tqdm=False)
            pids = llm.engine.executor.workers.pids if size > 1 else []
            for pid in pids:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read().split(b"\0")
                assert b"NCCL_NVLS_ENABLE=0" in environ and b"TORCH_SYMM_MEM_DISABLE_MULTICAST=1" in environ
    assert pids and not any(alive(p) for p in pids)
    for a, b in zip(results[1], results[2]):
        assert b.error is None
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)
        for sa, sb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert all(abs(sa[t].logprob - sb[t].logprob) < 1e-4 for t in sa)


def test_token_feed_reaches_every_rank(tmp_path):
    """A launched step whose last tokens come from the device (``TokenFeed``): the fed ids are
    written into the step buffer before it is broadcast, so the worker computes with them too."""
    from ingot.runner.model_runner import TokenFeed

    path = str(write_tiny_checkpoint(tmp_path / "qwen3", "qwen3"))
    fed = [42, 7, 100]

    def decode_tokens(engine, feed: bool, override: bool = True) -> list[int]:
        seqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)) for p in PROMPTS]
        while any(not s.output_token_ids for s in seqs):
            engine.step()  # prefill (chunked): each sequence has a token to decode from
        batch = engine.scheduler.schedule()
        assert not batch.is_prefill and len(batch.seqs) == 3
        if feed:
            step = engine.executor.launch(batch, (), TokenFeed(torch.tensor(fed), [0, 1, 2]))
        else:  # the same tokens from the host (or the sampled ones: ``override=False``)
            for seq, token in zip(seqs, fed):
                if override:
                    seq.output_token_ids[-1] = token
            step = engine.executor.launch(batch, ())
        tokens = step.collect().token_ids
        for seq in seqs:
            engine.abort(seq.request_id)
        return tokens

    ref_engine = Engine(EngineConfig.create(model=path, device="cpu", dtype="float32", show_progress=False, **ENGINE))
    expected = decode_tokens(ref_engine, feed=False)
    assert decode_tokens(ref_engine, feed=False, override=False) != expected  # the fed tokens matter
    assert decode_tokens(ref_engine, feed=True) == expected
    engine = tp_engine(path, tensor_parallel_size=2, **ENGINE)
    try:
        assert decode_tokens(engine, feed=True) == expected
    finally:
        engine.close()


def test_tp2_verify_steps_give_tp1_greedy_tokens(tmp_path):
    """Speculative decoding over two ranks: every rank runs each verify step's rows (their layout
    and store_first come in the step buffer); greedy output is TP1's plain greedy decoding."""
    path = str(write_tiny_checkpoint(tmp_path / "qwen3", "qwen3"))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    prompts = ["the quick brown fox jumps over the lazy dog. the quick", "hello world hello world"]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with LLM(path, device="cpu", dtype="float32", show_progress=False, **ENGINE) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(path, device="cpu", dtype="float32", show_progress=False, tensor_parallel_size=2, speculative_config=spec,
             **ENGINE) as llm:
        spec_tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.stats()
    assert spec_tokens == plain
    assert stats.spec_decode_num_draft_tokens > 0
