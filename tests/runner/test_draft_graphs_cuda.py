"""Draft-model speculative decoding on a real GPU (marked cuda; run on the H200): the draft's
decode, first-step and K/V-only graphs are captured with the target's into one pool, and greedy
decoding with the target as its own draft emits plain greedy decoding's tokens, keeping every
draft, with the draft's steps replayed from its graphs."""

from __future__ import annotations

import pytest

from ingot import LLM, SamplingParams
from tests.helpers import write_tiny_checkpoint

pytestmark = pytest.mark.cuda

PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick brown fox", "hello world hello world hello",
           "def f(x): return x", "Hello tokens Hello tokens Hello"]


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_greedy_with_itself_as_draft_through_graphs(tmp_path, arch):
    path = str(write_tiny_checkpoint(tmp_path / arch, arch, overrides={"vocab_size": 300}))
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    common = dict(dtype="float32", device="cuda", show_progress=False, max_num_seqs=8, max_model_len=256,
                  num_kv_blocks=256)
    with LLM(path, **common) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(path, speculative_config={"model": path, "num_speculative_tokens": 4}, **common) as llm:
        runner = llm.engine.executor
        draft = runner.draft
        for graphs in (draft.graphs, draft.verify_graphs, draft.kv_graphs):
            assert graphs is not None and all(e.graph is not None for e in graphs.entries.values())
        assert draft.graphs.pool == runner.graphs.pool, "one memory pool"
        rows: list[int] = []
        replay = draft.graphs.run
        draft.graphs.run = lambda inputs: rows.append(inputs.num_seqs) or replay(inputs)
        spec = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        stats = llm.engine.stats()
    assert spec == plain
    assert rows, "the draft's steps replayed its decode graphs"
    # the draft's one-row steps (skinny GEMVs, the fused decode attention) and the verify rows
    # (cuBLAS, K/V stored first) round differently: a near-tie may flip a draft
    assert stats.spec_decode_num_accepted_tokens >= 0.9 * stats.spec_decode_num_draft_tokens > 0
