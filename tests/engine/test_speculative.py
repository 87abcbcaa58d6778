"""Speculative decoding (n-gram prompt lookup): greedy output is plain greedy decoding's, token
for token, through stops, max_tokens, n > 1, logprobs, prefix caching and preemption; seeded
sampling is deterministic; rejected drafts leave no blocks behind; counters and metrics."""

from __future__ import annotations

import pytest

from ingot import LLM, SamplingParams
from tests.helpers import write_tiny_checkpoint

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
REPEATS = "the quick brown fox jumps over the lazy dog. " * 3
PROMPTS = [REPEATS, "hello world hello world hello", "def f(x): return x", "Hello tokens " * 6, "lazy"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "qwen2", "qwen2")


def run(path, spec, prompts, params, **engine):
    """(per request: per sample (token ids, text, finish reason, stop reason, logprobs)), the metrics, the stats."""
    with LLM(str(path), dtype="float32", device="cpu", show_progress=False, speculative_config=spec, **engine) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        sched = llm.engine.scheduler
        assert not llm.engine.requests and not sched.running and not sched.waiting
        assert sched.blocks.num_free == sched.blocks.num_blocks - 1, "every block came back"
        result = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs]
        return result, [o.metrics for o in outs], llm.engine.stats()


def same(a, b) -> None:
    """Equal outputs; logprobs equal to fp32 rounding (verify logits come from the verify rows)."""
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        for (ta, xa, fa, sa, la), (tb, xb, fb, sb, lb) in zip(ra, rb):
            assert (ta, xa, fa, sa) == (tb, xb, fb, sb)
            assert (la is None) == (lb is None)
            for pa, pb in zip(la or [], lb or []):
                assert pa.keys() == pb.keys()
                for t in pa:
                    assert pa[t].rank == pb[t].rank and abs(pa[t].logprob - pb[t].logprob) < 1e-4


def greedy_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True, n=2),
        SamplingParams(temperature=0.0, max_tokens=40, stop=["og"], include_stop_str_in_output=True),
        SamplingParams(temperature=0.0, max_tokens=37, stop_token_ids=[7, 11, 13]),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
    ]


def test_greedy_equals_plain_greedy(tiny):
    plain, _, _ = run(tiny, None, PROMPTS, greedy_params())
    spec, metrics, stats = run(tiny, SPEC, PROMPTS, greedy_params())
    same(spec, plain)
    assert stats.spec_decode_num_accepted_tokens > 20, "drafts were accepted"
    assert stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_accepted_tokens
    assert stats.spec_decode_num_drafts == sum(m.spec_num_drafts for m in metrics)
    m = max(metrics, key=lambda m: m.spec_num_accepted_tokens)
    assert 0 < m.spec_acceptance_rate <= 1 and 0 < m.spec_mean_accepted_length <= SPEC["num_speculative_tokens"]


def test_greedy_equal_without_overlap_and_prefix_caching_and_under_preemption(tiny):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain, _, _ = run(tiny, None, PROMPTS, params, num_kv_blocks=14, overlap_scheduling=False)
    spec, _, stats = run(tiny, SPEC, PROMPTS, params, num_kv_blocks=14, enable_prefix_caching=False)
    same(spec, plain)
    assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0


def test_seeded_sampling_is_deterministic_whatever_the_batch(tiny):
    seeded = SamplingParams(temperature=0.1, seed=5, max_tokens=30, ignore_eos=True, n=2, logprobs=1)
    alone, metrics, _ = run(tiny, SPEC, [PROMPTS[0]], seeded)
    assert metrics[0].spec_num_accepted_tokens > 0
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batched, _, stats = run(tiny, SPEC, PROMPTS[:3], [seeded, other, other])
    same(batched[:1], alone)
    assert stats.spec_decode_num_drafts > 0


def test_large_batches_do_not_speculate(tiny):
    spec = {**SPEC, "disable_by_batch_size": 2}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain, _, _ = run(tiny, None, PROMPTS[:3], params)
    out, _, stats = run(tiny, spec, PROMPTS[:3], params)
    same(out, plain)
    assert stats.spec_decode_num_drafts == 0, "three running sequences never speculate"


def test_penalties_do_not_speculate(tiny):
    params = SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.2, ignore_eos=True)
    out, _, stats = run(tiny, SPEC, [PROMPTS[0]], params)
    assert out == run(tiny, None, [PROMPTS[0]], params)[0]
    assert stats.spec_decode_num_drafts == 0
