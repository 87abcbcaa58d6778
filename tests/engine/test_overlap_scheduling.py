"""Overlap scheduling (step n+1 queued before step n is read back) computes what the serial
engine computes: the same tokens, texts, finish reasons and logprobs, through stops that
apply one step late, preemption, aborts, n samples, prefix caching and the penalty fallback."""

from __future__ import annotations

import pytest
import torch

from ingot import LLM, SamplingParams
from tests.helpers import write_tiny_checkpoint

PROMPTS = ["hello world", "the quick brown fox jumps over", "def f(x): return x", "lazy dog", "Hello tokens " * 6]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("overlap") / "qwen2", "qwen2")


def run(path, overlap: bool, prompts, params, device: str = "cpu", **engine) -> list:
    with LLM(str(path), dtype="float32", device=device, show_progress=False, overlap_scheduling=overlap, **engine) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        sched = llm.engine.scheduler
        assert not llm.engine.requests and not sched.running and not sched.waiting
        assert sched.blocks.num_free == sched.blocks.num_blocks - 1
        assert llm.engine._inflight is None or all(s.finished for s in llm.engine._inflight.sampled)
        return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs]


def mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, seed=4, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop=["o"], include_stop_str_in_output=True),
        SamplingParams(temperature=0.8, seed=9, n=3, max_tokens=9),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[7, 11, 13, 17, 19, 23]),
    ]


def test_mixed_requests_equal_the_serial_engine(tiny, monkeypatch):
    from ingot.runner import model_runner

    fed = []
    real = model_runner.TokenFeed.apply
    monkeypatch.setattr(model_runner.TokenFeed, "apply", lambda self, inputs, batch: fed.append(len(batch.seqs)) or real(self, inputs, batch))
    serial = run(tiny, False, PROMPTS, mixed_params())
    assert fed == []
    assert run(tiny, True, PROMPTS, mixed_params()) == serial
    assert len(fed) > 10, "steps were queued behind the step before them, reading its tokens on the device"


def test_penalties_and_min_tokens_fall_back_and_agree(tiny):
    params = [SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=2, max_tokens=16, frequency_penalty=0.8, presence_penalty=0.5),
              SamplingParams(temperature=0.0, max_tokens=16, min_tokens=10, stop_token_ids=list(range(3, 300, 2)))]
    assert run(tiny, True, PROMPTS[:3], params) == run(tiny, False, PROMPTS[:3], params)


def test_preemption_and_chunked_prefill_agree(tiny):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    small = dict(num_kv_blocks=14, max_num_batched_tokens=24, enable_prefix_caching=False)
    serial = run(tiny, False, PROMPTS * 2, params, **small)
    assert run(tiny, True, PROMPTS * 2, params, **small) == serial


def test_prefix_caching_agrees(tiny):
    shared = "The quick brown fox jumps over the lazy dog. " * 3
    prompts = [shared + p for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    assert run(tiny, True, prompts, params) == run(tiny, False, prompts, params)


def test_streams_and_aborts_with_overlap(tiny):
    with LLM(str(tiny), dtype="float32", device="cpu", show_progress=False, overlap_scheduling=True) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
        full = llm.generate("hello world", params)[0].outputs[0]
        chunks = list(llm.stream("hello world", params))
        assert "".join(c.delta for c in chunks) == full.text and chunks[-1].outputs[0].token_ids == full.token_ids
        stream = llm.stream("the quick brown fox", SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        for _ in range(4):
            next(stream)
        stream.close()
        again = llm.generate("hello world", params)[0].outputs[0]
        assert again.token_ids == full.token_ids
        sched = llm.engine.scheduler
        assert not llm.engine.requests and sched.blocks.num_free == sched.blocks.num_blocks - 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_overlap_equals_the_serial_engine(tiny):
    """On the GPU (decode graphs, Triton kernels, asynchronous copies) the queued step reads
    the previous step's tokens on the device. Equal lengths keep every step's batch the same
    in both engines (a stop would add one row to the step after it), so the results are
    bitwise equal."""
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, seed=4, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=9, n=2, max_tokens=40, ignore_eos=True)]
    prompts = PROMPTS * 6
    params = [params[i % 3] for i in range(len(prompts))]
    assert run(tiny, True, prompts, params, "cuda") == run(tiny, False, prompts, params, "cuda")
