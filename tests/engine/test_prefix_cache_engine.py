"""Prefix caching through the real engine: greedy fp32 outputs equal those without it.

Random tiny checkpoints (two architectures) and SmolLM2-135M. Requests come in
waves: a wave runs to completion before the next one is added, so later waves
find the earlier waves' blocks in the prefix cache.
"""

from __future__ import annotations

import random

import pytest

from ingot import LLM
from ingot.sampling_params import SamplingParams
from tests.engine.fake_steps import check_all_free, check_invariants
from tests.helpers import write_tiny_checkpoint

BS = 4
rng = random.Random(0)
A = [rng.randrange(5, 380) for _ in range(40)]
OTHER = [rng.randrange(5, 380) for _ in range(40)]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("apc") / request.param, request.param))


def engine_of(path, caching: bool, **kw):
    kw = {"block_size": BS, "max_num_seqs": 8, **kw}
    return LLM(path, dtype="float32", device="cpu", show_progress=False, enable_prefix_caching=caching, **kw).engine


def greedy(n: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run_waves(engine, waves, max_tokens: int = 10, between=None):
    """Each wave's prompts run together to completion; ``between(engine, seqs)`` runs after every step."""
    seqs = []
    for w, wave in enumerate(waves):
        batch = [engine.add_request(p, greedy(max_tokens), f"w{w}-{i}", stream=False) for i, p in enumerate(wave)]
        seqs += batch
        while engine.has_unfinished():
            engine.step()
            check_invariants(engine.scheduler)
            if between is not None:
                between(engine, batch)
    check_all_free(engine.scheduler)
    for s in seqs:
        engine.requests.pop(s.request_id, None)
    return seqs


def outputs(seqs):
    return [list(s.output_token_ids) for s in seqs]


def test_prompts_sharing_none_some_and_all_of_their_blocks(tiny):
    waves = [[A[:30]], [A[:12] + OTHER[:5], A[:30], A[:28], OTHER[:30], A[:30] + OTHER[:3], A[:2]]]
    on = run_waves(engine_of(tiny, True), waves)
    off = run_waves(engine_of(tiny, False), waves)
    assert outputs(on) == outputs(off)
    # 12 shared tokens; all 7 full blocks + 2 tokens; 7 full blocks (the last one recomputed);
    # nothing shared; 28 shared of 33; no full block
    assert [s.num_cached_tokens for s in on] == [0, 12, 28, 24, 0, 28, 0]
    assert [s.num_cached_tokens for s in off] == [0] * 7


def test_chunked_prefill_across_a_cached_prefix(tiny):
    waves = [[A], [A[:32] + OTHER[:10], A[:21] + OTHER[:20], A[:40] + OTHER[:1]]]
    eng = engine_of(tiny, True, max_num_batched_tokens=8)
    chunks = []
    schedule = eng.scheduler.schedule

    def recording():
        batch = schedule()
        if batch is not None and batch.is_prefill:
            chunks.append(sum(batch.num_new_tokens))
        return batch

    eng.scheduler.schedule = recording
    on = run_waves(eng, waves)
    assert max(chunks) <= 8 and [s.num_cached_tokens for s in on] == [0, 32, 20, 40]
    assert outputs(on) == outputs(run_waves(engine_of(tiny, False), waves))


def test_preemption_with_shared_blocks(tiny):
    prefix = A[:16]
    waves = [[prefix + [7]], [prefix + OTHER[i : i + 6] for i in range(6)]]
    # 12 usable blocks for six 22-token prompts growing to 34 tokens: 4 shared + 3-5 own each
    small = engine_of(tiny, True, num_kv_blocks=13, max_model_len=48, max_num_batched_tokens=16)
    on = run_waves(small, waves, max_tokens=12)
    stats = small.scheduler.stats
    assert stats.num_preemptions > 0, "the test must exercise preemption"
    assert stats.prefix_cache_hits >= 6 * 16
    assert outputs(on) == outputs(run_waves(engine_of(tiny, False), waves, max_tokens=12))


def test_abort_of_requests_whose_blocks_are_shared(tiny):
    waves = [[A[:24]], [A[:24] + OTHER[:3], A[:20] + OTHER[3:9], A[:16] + OTHER[9:11]]]
    aborted = set()

    def abort_some(engine, batch):
        if len(batch) == 3 and len(batch[1].output_token_ids) == 3 and not batch[0].finished:
            engine.abort(batch[0].request_id)  # holds blocks the other two hold too
            aborted.add(batch[0].request_id)
        if len(batch) == 3 and len(batch[2].output_token_ids) == 5 and not batch[1].finished:
            engine.abort(batch[1].request_id)
            aborted.add(batch[1].request_id)

    eng = engine_of(tiny, True)
    on = run_waves(eng, waves, between=abort_some)
    assert aborted == {"w1-0", "w1-1"} and all(s.finish_reason == "abort" for s in on[1:3])
    assert [s.num_cached_tokens for s in on] == [0, 24, 20, 16]
    off = run_waves(engine_of(tiny, False), waves)
    assert outputs(on)[0] == outputs(off)[0] and outputs(on)[3] == outputs(off)[3]
    for got, want in zip(outputs(on)[1:3], outputs(off)[1:3]):
        assert got == want[: len(got)], "an aborted request's tokens so far are right too"
    # the pool ended fully free (run_waves): the aborted requests' shared blocks were released once each
    assert len(eng.scheduler.blocks.evictable) == len(eng.scheduler.blocks.cached) > 0


def test_smollm2_shared_system_prompt(smollm2_gguf):
    path = str(smollm2_gguf)
    common = dict(dtype="float32", device="cpu", show_progress=False, max_model_len=256, num_kv_blocks=48)
    on_llm = LLM(path, **common)
    tok = on_llm.get_tokenizer()
    system = "You are a careful assistant. Answer in one short sentence, plainly, without lists or preambles. " * 2
    questions = ["What is the capital of France?", "Why is the sky blue?", "What do bees make?"]
    prompts = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                       add_generation_prompt=True, tokenize=False) for q in questions]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    shared = next(i for i, col in enumerate(zip(*ids)) if len(set(col)) > 1)
    assert shared >= 32, "the prompts share at least two 16-token blocks"
    waves = [ids[:1], ids[1:]]
    on = run_waves(on_llm.engine, waves, max_tokens=8)
    off = run_waves(LLM(path, enable_prefix_caching=False, **common).engine, waves, max_tokens=8)
    assert outputs(on) == outputs(off)
    assert [s.num_cached_tokens for s in on[1:]] == [shared // 16 * 16] * 2


@pytest.mark.cuda
def test_cuda_shared_prefix_through_the_triton_kernels(smollm2_gguf):
    """bf16 on the GPU: the paged prefill over cached context and graph decode agree with a
    full prefill (greedy; the first 8 tokens of each reply, where bf16 rounding cannot yet
    have moved a near-tie)."""
    path = str(smollm2_gguf)
    # small pools: two engines share the GPU
    common = dict(dtype="bfloat16", device="cuda", show_progress=False, max_model_len=512, max_num_seqs=8, num_kv_blocks=128)
    on_llm = LLM(path, **common)
    tok = on_llm.get_tokenizer()
    system = "You are a careful assistant. Answer in one short sentence, plainly, without lists or preambles. " * 4
    questions = ["What is the capital of France?", "Why is the sky blue?", "What do bees make?", "Name a prime number."]
    ids = [tok.encode(tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                              add_generation_prompt=True, tokenize=False), add_special_tokens=False)
           for q in questions]
    waves = [ids[:1], ids[1:]]
    on = run_waves(on_llm.engine, waves, max_tokens=8)
    off = run_waves(LLM(path, enable_prefix_caching=False, **common).engine, waves, max_tokens=8)
    assert all(s.num_cached_tokens >= 64 for s in on[1:])
    assert outputs(on) == outputs(off)
