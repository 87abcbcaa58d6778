"""Prefill CUDA graphs on a real GPU (marked cuda), on tiny random checkpoints of four
families (q/k norm, MoE, sliding window with soft-capping, MLA): every replay equals the
padded raw forward bit for bit, and each prompt's first-token logprobs match the eager
engine's (where the padding changes only the kernels' row counts)."""

from __future__ import annotations

import pytest
import torch

from ingot import LLM, SamplingParams
from tests.helpers import write_tiny_checkpoint

pytestmark = pytest.mark.cuda

ARCHS = ["qwen3", "qwen3_moe", "gemma2", "deepseek_v2"]
LENGTHS = [3, 8, 21, 100, 230]  # under the smallest bucket, on one, between, two long ones


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("pgc") / request.param, request.param)


def engine(path, **kw) -> LLM:
    return LLM(str(path), dtype="bfloat16", device="cuda", max_num_seqs=4, cudagraph_capture_sizes=(1, 4),
               show_progress=False, gpu_memory_utilization=0.3, enable_prefix_caching=False, **kw)


def first_logprobs(llm: LLM) -> list[dict[int, float]]:
    """Each prompt alone (one sequence a prefill): its first token's top-5 logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = [(11 * i + 7 * j) % 300 + 3 for j in range(n)]
        o = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
        out.append({t: lp.logprob for t, lp in o.logprobs[0].items()})
    return out


def test_prefill_replay_bitwise_equals_its_padded_forward(tiny, monkeypatch):
    llm = engine(tiny)
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
    first_logprobs(llm)
    assert seen == [(3, 8), (8, 8), (21, 24), (100, 128), (230, 256)] and not mismatches, (seen, mismatches)


def test_prefill_graphs_give_the_eager_first_logprobs(tiny):
    graphed = first_logprobs(engine(tiny))
    eager = first_logprobs(engine(tiny, enforce_eager=True))
    for g, e in zip(graphed, eager):
        top = max(e, key=e.get)
        assert top in g and abs(g[top] - e[top]) < 0.05, (g, e)
