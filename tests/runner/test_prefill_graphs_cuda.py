"""Prefill CUDA graphs on a real GPU (marked cuda): every replay equals the padded raw forward
bit for bit, and the first tokens and their logprobs match the eager engine's."""

from __future__ import annotations

import pytest
import torch

from ingot import LLM, SamplingParams

pytestmark = pytest.mark.cuda

TEXTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "Once upon a time, in a small village, there lived an old clockmaker who " * 6,
    "import torch\nimport numpy as np\n\n",
    "List the planets of the solar system in order from the sun, with one fact about each. " * 12,
]


def engine(smollm2_gguf, **kw) -> LLM:
    return LLM(str(smollm2_gguf), dtype="bfloat16", device="cuda", max_num_seqs=4, cudagraph_capture_sizes=(1, 4),
               show_progress=False, max_model_len=2048, gpu_memory_utilization=0.3, enable_prefix_caching=False, **kw)


def first_tokens(llm: LLM) -> list[tuple[int, float]]:
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
    outs = [llm.generate([t], params, use_tqdm=False)[0].outputs[0] for t in TEXTS]  # one sequence a prefill
    return [(o.token_ids[0], o.logprobs[0][o.token_ids[0]].logprob) for o in outs]


def test_prefill_replay_bitwise_equals_its_padded_forward(smollm2_gguf, monkeypatch):
    llm = engine(smollm2_gguf)
    pg = llm.engine.executor.prefill_graphs
    assert pg is not None and pg.graphs, "prefill graphs captured"
    seen, mismatches = [], []

    def checked_run(inputs):
        n = inputs.input_ids.shape[0]
        bucket = pg.bucket_for(n)
        pg.fill(inputs, bucket)
        with torch.inference_mode():
            raw = pg.forward(bucket).clone()
        pg.graphs[bucket].replay()
        seen.append((n, bucket))
        if not torch.equal(pg.outputs[bucket], raw):
            mismatches.append((n, bucket))
        return pg.outputs[bucket]

    monkeypatch.setattr(pg, "run", checked_run)
    first_tokens(llm)
    assert len(seen) == len(TEXTS) and not mismatches, (seen, mismatches)


def test_prefill_graphs_give_the_eager_first_tokens(smollm2_gguf):
    graphed = first_tokens(engine(smollm2_gguf))
    eager = first_tokens(engine(smollm2_gguf, enforce_eager=True))
    assert [t for t, _ in graphed] == [t for t, _ in eager]
    assert max(abs(a - b) for (_, a), (_, b) in zip(graphed, eager)) < 0.05
