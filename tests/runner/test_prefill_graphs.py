"""Prefill graphs on CPU through the padded path (``CPU_BUCKETS``): which prefills take it,
and that padding a prompt's tokens up to a bucket leaves its outputs as the eager engine's."""

from __future__ import annotations

import pytest

from ingot import LLM, SamplingParams
from ingot.runner import graph_runner, prefill_graphs
from ingot.runner.prefill_graphs import PrefillGraphRunner, prefill_buckets
from tests.helpers import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("pg") / "qwen3", "qwen3")


def make(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", show_progress=False, max_num_seqs=4, **kw)


def test_prefill_buckets():
    assert prefill_buckets(512) == [8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert prefill_buckets(100) == [8, 12, 16, 24, 32, 48, 64, 96, 100]
    assert prefill_buckets(6) == [6]


def spy_runs(monkeypatch) -> list[tuple[int, int]]:
    """(real tokens, bucket) of every prefill graph replay."""
    runs: list[tuple[int, int]] = []
    real = PrefillGraphRunner.run

    def run(self, inputs):
        n = inputs.input_ids.shape[0]
        runs.append((n, self.bucket_for(n)))
        return real(self, inputs)

    monkeypatch.setattr(PrefillGraphRunner, "run", run)
    return runs


def prompts(n: int, lengths: list[int]) -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + 13 * j) % 370 + 3 for j in range(length)]} for i, length in enumerate(lengths[:n])]


def one_by_one(llm: LLM, batch: list[dict], params: SamplingParams) -> list[list[int]]:
    """Each prompt alone, so each prefill step holds one sequence."""
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in batch]


LENGTHS = [1, 5, 8, 13, 50, 130]  # under the smallest bucket, on one, between, past the largest (eager)


def test_padded_prefills_give_the_eager_outputs(tiny, monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    batch = prompts(len(LENGTHS), LENGTHS)
    eager = one_by_one(make(tiny, eager_mode=True), batch, params)
    monkeypatch.setattr(graph_runner, "CPU_BUCKETS", True)
    monkeypatch.setattr(prefill_graphs, "PREFILL_GRAPH_MAX_TOKENS", 64)  # the tiny model's context is 256
    runs = spy_runs(monkeypatch)
    llm = make(tiny)
    assert llm.engine.executor.prefill_graphs.buckets == [8, 12, 16, 24, 32, 48, 64]
    assert one_by_one(llm, batch, params) == eager
    assert runs == [(1, 8), (5, 8), (8, 8), (13, 16), (50, 64)], "one replay per prompt up to the largest bucket"


def test_several_sequences_and_prompt_logprobs_stay_eager(tiny, monkeypatch):
    monkeypatch.setattr(graph_runner, "CPU_BUCKETS", True)
    runs = spy_runs(monkeypatch)
    llm = make(tiny)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate(prompts(3, [20, 30, 40]), params, use_tqdm=False)  # one prefill step of three sequences
    llm.generate(prompts(1, [20]), SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
    assert runs == []


def test_chunks_and_prefix_hits_replay_with_their_cached_context(tiny, monkeypatch):
    """A prompt chunked by the token budget: the chunks that sample nothing run eagerly, the
    last one replays over its cached context; a prefix-cache hit prefills only its new tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    long_prompt = prompts(1, [150])[0]
    shared = {"prompt_token_ids": long_prompt["prompt_token_ids"][:96] + [9, 8, 7, 6, 5]}
    eager_llm = make(tiny, eager_mode=True, max_num_batched_tokens=64, enable_prefix_caching=False)
    eager = one_by_one(eager_llm, [long_prompt, shared], params)
    monkeypatch.setattr(graph_runner, "CPU_BUCKETS", True)
    runs = spy_runs(monkeypatch)
    llm = make(tiny, max_num_batched_tokens=64, enable_prefix_caching=True)
    assert one_by_one(llm, [long_prompt, shared], params) == eager
    # chunks of 64, 64, then the sampled 22 over 128 cached tokens (padded to 24); the shared
    # prompt's 6 cached blocks are not prefilled again
    assert runs == [(22, 24), (5, 8)]
