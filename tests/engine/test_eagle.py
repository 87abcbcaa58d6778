"""EAGLE-1 and EAGLE-3 heads (``method: "eagle" | "eagle3"``): tiny random heads in their
published formats draft exactly what an independent PyTorch reference over HF transformers'
hidden states of the target drafts (``eagle_heads.py``), round after round, through prefill
chunks, decode and verify steps, rounds that kept every draft, preemption and prefix-cache hits
(the head catching up from the hidden-state cache); greedy output is plain greedy decoding's;
bad heads are refused at start-up."""

from __future__ import annotations


import pytest

from ingot import LLM, SamplingParams
from ingot.config import ConfigError
from ingot.runner.eagle_runner import EagleRunner
from tests.engine.eagle_heads import check_against_reference, write_eagle1, write_eagle3
from tests.engine.test_speculative import PROMPTS, greedy_params, run, same
from tests.helpers import hf_model, watch_draft_steps, write_tiny_checkpoint

VOCAB = 300
K = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    target = write_tiny_checkpoint(root / "target", "llama", overrides={"vocab_size": VOCAB, "num_hidden_layers": 8})
    return {
        "target": target,
        "hf": hf_model(target),
        "eagle3": write_eagle3(root / "eagle3", VOCAB, draft_vocab=120),
        "eagle3_full": write_eagle3(root / "eagle3_full", VOCAB, None, seed=1, aux=[0, 3, 7], embed=True, fmt="bin"),
        "speculators": write_eagle3(root / "speculators", VOCAB, 150, seed=3, aux=[1, 4, 6], speculators=True),
        "eagle1": write_eagle1(root / "eagle1", VOCAB, seed=2),
    }


def spec(path, method: str, k: int = K) -> dict:
    return {"method": method, "model": str(path), "num_speculative_tokens": k}


PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("head,variant", [("eagle3", "eagle3"), ("eagle3_full", "eagle3"), ("speculators", "eagle3"),
                                          ("eagle1", "eagle")])
def test_drafts_equal_the_reference_and_output_plain_greedy(models, proposals, head, variant):
    plain, _, _ = run(models["target"], None, PROMPTS, greedy_params())
    out, _, stats = run(models["target"], spec(models[head], variant), PROMPTS, greedy_params())
    same(out, plain)
    assert stats.spec_decode_num_drafts > 0
    check_against_reference(models, head, variant, proposals)


@pytest.mark.parametrize("head,variant", [("eagle3", "eagle3"), ("eagle1", "eagle")])
def test_rounds_that_keep_every_draft(models, proposals, agreeing, head, variant):
    _, _, stats = run(models["target"], spec(models[head], variant), PROMPTS[:3], PARAMS)
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    check_against_reference(models, head, variant, proposals)


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "qwen3_moe", "deepseek_v2"])
def test_other_targets_hand_their_hidden_states_over(models, proposals, agreeing, tmp_path, arch):
    """Qwen3 (q/k norms), Gemma 2 (scaled embeddings, post-norms, soft-capped logits), Qwen3-MoE
    and DeepSeek-V2 (latent attention, shared experts) targets: the residual streams they store
    are HF's, the drafts the reference's."""
    target = write_tiny_checkpoint(tmp_path / arch, arch, overrides={"vocab_size": VOCAB, "num_hidden_layers": 8})
    _, _, stats = run(target, spec(models["eagle3"], "eagle3"), PROMPTS[:3], PARAMS)
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    check_against_reference({**models, "hf": hf_model(target)}, "eagle3", "eagle3", proposals)


def test_preemption_catches_up_from_the_hidden_cache(models, proposals, agreeing):
    """A small KV pool preempts sequences and recomputes them; the head's K/V is rebuilt from the
    hidden rows the recompute writes; the drafts stay the reference's."""
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    _, _, stats = run(models["target"], spec(models["eagle3"], "eagle3"), PROMPTS, params, num_kv_blocks=14)
    assert stats.num_preemptions > 0
    check_against_reference(models, "eagle3", "eagle3", proposals)


def test_prefix_hits_and_chunks_catch_up_from_the_hidden_cache(models, proposals, agreeing):
    """Prompts that continue earlier outputs hit blocks that prefill, decode and verify steps
    wrote (the target's K/V and hidden rows reused, the head's K/V caught up from the rows),
    prefilled in chunks; the drafts stay the reference's."""
    common = dict(dtype="float32", device="cpu", show_progress=False, speculative_config=spec(models["eagle3"], "eagle3"),
                  max_num_batched_tokens=24, max_num_seqs=4)
    with LLM(str(models["target"]), **common) as llm:
        first = llm.generate(PROMPTS[:3], PARAMS, use_tqdm=False)
        follow = [{"prompt_token_ids": o.prompt_token_ids + o.outputs[0].token_ids + [5, 6]} for o in first]
        llm.generate(follow, PARAMS, use_tqdm=False)
        stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0
    check_against_reference(models, "eagle3", "eagle3", proposals)


def test_head_steps_through_the_padded_buckets(models, proposals, agreeing, cpu_buckets):
    """On the graphs' path (CPU_BUCKETS, padded rows at the dummy slot): the head's decode,
    first-step (kept drafts fed again, store_first) and K/V-only buckets all replay, the
    target's buckets store the hidden rows, and the drafts stay the reference's; with three
    sequences (above disable_by_batch_size 2) the head sits out and catches up after."""
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (30, 30, 8)]
    head = {**spec(models["eagle3"], "eagle3"), "disable_by_batch_size": 2}
    with LLM(str(models["target"]), speculative_config=head, dtype="float32", device="cpu", show_progress=False,
             max_num_seqs=4) as llm:
        draft = llm.engine.executor.draft
        assert draft.verify_graphs.buckets == [2, 3, 4, 6, 8], "up to k + 1 rows a sequence"
        rows = watch_draft_steps(llm)
        llm.generate(PROMPTS[:3], params, use_tqdm=False)
    check_against_reference(models, "eagle3", "eagle3", proposals)
    assert rows["decode"] and rows["first"] and rows["kv"], f"every set replayed: {rows}"


def test_sampled_requests_keep_the_target_distribution_machinery(models):
    """Seeded sampling with an EAGLE-3 head over a draft vocabulary (its drafts drawn from the
    head's distribution, -inf outside the draft ids) runs and repeats with its seed."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=s, ignore_eos=True) for s in (1, 2)]
    a, _, _ = run(models["target"], spec(models["eagle3"], "eagle3"), PROMPTS[:2], params)
    b, _, _ = run(models["target"], spec(models["eagle3"], "eagle3"), PROMPTS[:2], params)
    assert a == b


def test_bad_heads_are_refused_at_start_up(models, tmp_path):
    target = str(models["target"])

    def refused(head, method: str, match: str) -> None:
        with pytest.raises(ConfigError, match=match):
            LLM(target, device="cpu", dtype="float32", show_progress=False, speculative_config=spec(head, method))

    refused(models["eagle3"], "eagle", "is an EAGLE-3 head")
    refused(models["eagle1"], "eagle3", "not an EAGLE-3 head")
    refused(tmp_path / "nowhere", "eagle3", "does not exist")
    write_eagle3(tmp_path / "far", VOCAB, 120, aux=[2, 9, 12])
    refused(tmp_path / "far", "eagle3", r"within the target's 8 layers")
    nod2t = write_eagle3(tmp_path / "nod2t", VOCAB, 120)
    from safetensors.torch import load_file, save_file

    w = load_file(str(nod2t / "model.safetensors"))
    del w["d2t"]
    save_file(w, str(nod2t / "model.safetensors"))
    refused(nod2t, "eagle3", "needs d2t")
    with pytest.raises(ConfigError, match="needs 'model'"):
        LLM(target, device="cpu", speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    mistral = write_tiny_checkpoint(tmp_path / "mistral", "mistral", overrides={"vocab_size": VOCAB, "num_hidden_layers": 8,
                                                                                "sliding_window": 16})
    with pytest.raises(ConfigError, match="within 16 tokens in every layer"):
        LLM(str(mistral), device="cpu", dtype="float32", show_progress=False, speculative_config=spec(models["eagle3"], "eagle3"))
    wide = write_tiny_checkpoint(tmp_path / "wide", "llama", overrides={"vocab_size": VOCAB, "hidden_size": 96,
                                                                         "num_hidden_layers": 8})
    with pytest.raises(ConfigError, match="fc reads 192 features, not 3 target layers x 96"):
        LLM(str(wide), device="cpu", dtype="float32", show_progress=False, speculative_config=spec(models["eagle3"], "eagle3"))


def test_hidden_rows_cost_kv_pool_bytes(models):
    """The pool's bytes per block hold the target's K/V, the head's and a hidden row per slot."""
    with LLM(str(models["target"]), device="cpu", dtype="float32", show_progress=False,
             speculative_config=spec(models["eagle3"], "eagle3")) as llm:
        runner = llm.engine.executor
        plain = super(EagleRunner, runner)._bytes_per_block()
        assert runner._bytes_per_block() - plain == runner.block_size * 64 * 4
        assert runner.head.sink.cache.shape == (llm.engine.scheduler.blocks.num_blocks * runner.block_size, 64)
        assert runner.model.hidden_sink is runner.head.sink


def test_random_heads_for_shapes_fit_their_target():
    """``{"method": "eagle3", "model": SHAPE}``: a random head with the shape's layer (what the
    benchmarks time on random weights), reading the default three target layers."""
    from ingot.loading.dummy import shape_config
    from ingot.loading.eagle import RANDOM_DRAFT_VOCAB, open_eagle_head
    from ingot.loading.model_config import ModelConfig

    target = ModelConfig.from_hf(shape_config("qwen2.5-7b"))
    head = open_eagle_head("qwen2.5-7b", "eagle3", target)
    assert head.spec.aux_layers == (2, 14, 25) and head.spec.draft_vocab_size == RANDOM_DRAFT_VOCAB
    assert head.tensors["fc.weight"].shape == (3584, 3 * 3584)
    assert head.tensors["layers.0.self_attn.q_proj.weight"].shape == (3584, 2 * 3584)
    assert head.tensors["layers.0.mlp.down_proj.weight"].shape == (3584, 18944)
    assert head.config.vocab_size == target.vocab_size and not head.config.qkv_bias
    one = open_eagle_head("qwen2.5-7b", "eagle", target)
    assert one.spec.aux_layers == () and one.tensors["fc.weight"].shape == (3584, 2 * 3584)
    assert "lm_head.weight" not in one.tensors
    with pytest.raises(Exception, match="hidden size 1536, the target 3584"):
        open_eagle_head("qwen2.5-1.5b", "eagle3", target)


def test_grammar_rows_with_a_head_equal_plain_greedy(models):
    """Structured outputs with an EAGLE-3 head: each verify position masked by the grammar
    walked through the drafts before it; output plain greedy decoding's under the same grammar,
    every answer valid."""
    import json
    import re

    import jsonschema

    from tests.engine.test_speculative_grammar import PROMPTS as GRAMMAR_PROMPTS, REGEX, SCHEMA, params

    def decode(speculative):
        with LLM(str(models["target"]), dtype="float32", device="cpu", show_progress=False,
                 speculative_config=speculative) as llm:
            outs = llm.generate([p for p in GRAMMAR_PROMPTS for _ in range(3)], params() * len(GRAMMAR_PROMPTS),
                                use_tqdm=False)
            return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs], outs

    plain, _ = decode(None)
    out, outs = decode(spec(models["eagle3"], "eagle3"))
    assert out == plain
    assert sum(o.metrics.spec_num_drafts for o in outs) > 0
    for k, (_, text, reason) in enumerate(out):
        if k % 3 == 0:
            assert reason == "stop"
            assert re.fullmatch(REGEX, text), text
        elif k % 3 == 1:
            assert reason == "stop"
            jsonschema.validate(json.loads(text), SCHEMA)
