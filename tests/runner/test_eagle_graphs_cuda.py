"""EAGLE heads on a real GPU (marked cuda): the head's decode, first-step and K/V-only graphs are
captured with the target's (whose decode and verify graphs store the hidden rows), every round
keeps its drafts (the target made to agree), and the drafts the replayed graphs propose are
the independent reference's (``tests/engine/eagle_heads.py``, on the CPU over HF transformers);
greedy output without that help is plain greedy decoding's."""

from __future__ import annotations

import pytest

from ingot import LLM, SamplingParams
from tests.engine.eagle_heads import check_against_reference, write_eagle1, write_eagle3
from tests.engine.test_eagle import PARAMS, VOCAB, spec
from tests.helpers import hf_model, write_tiny_checkpoint

pytestmark = pytest.mark.cuda

PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick brown fox", "hello world hello world hello",
           "def f(x): return x", "Hello tokens Hello tokens Hello"]
COMMON = dict(dtype="float32", device="cuda", show_progress=False, max_num_seqs=8, max_model_len=256, num_kv_blocks=256)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_cuda")
    target = write_tiny_checkpoint(root / "target", "llama", overrides={"vocab_size": VOCAB, "num_hidden_layers": 8})
    return {"target": target, "hf": hf_model(target), "eagle3": write_eagle3(root / "eagle3", VOCAB, draft_vocab=120),
            "eagle1": write_eagle1(root / "eagle1", VOCAB, seed=2)}


@pytest.mark.parametrize("head,variant", [("eagle3", "eagle3"), ("eagle1", "eagle")])
def test_drafts_through_graphs_equal_the_reference(models, proposals, agreeing, head, variant):
    with LLM(str(models["target"]), speculative_config=spec(models[head], variant), **COMMON) as llm:
        runner = llm.engine.executor
        draft = runner.draft
        for graphs in (draft.graphs, draft.verify_graphs, draft.kv_graphs, runner.graphs, runner.verify_graphs):
            assert graphs is not None and all(e.graph is not None for e in graphs.entries.values())
        replays: list[int] = []
        for graphs in (draft.graphs, draft.verify_graphs):
            run = graphs.run
            graphs.run = lambda inputs, run=run: replays.append(inputs.num_seqs) or run(inputs)
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        stats = llm.engine.stats()
    assert replays, "the head's steps replayed its graphs"
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    check_against_reference(models, head, variant, proposals)


def test_greedy_equals_plain_greedy(models):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    with LLM(str(models["target"]), **COMMON) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(str(models["target"]), speculative_config=spec(models["eagle3"], "eagle3"), **COMMON) as llm:
        out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert out == plain
