"""Speculative decoding with a draft model: greedy output is plain greedy decoding's, token for
token, with a random draft of another architecture (low acceptance) and with the target as its
own draft (every draft kept: the draft's K/V follows the target's through prefill, decode and
verify steps, preemption, prefix-cache hits and a round that kept every draft, and is caught up
after steps it sat out: ``test_draft_skip.py``), through stops,
max_tokens, n > 1 and logprobs; padded embedding tables; the draft's padded bucket path; bad
configurations refused at start-up."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from ingot import LLM, SamplingParams
from ingot.config import ConfigError, EngineConfig
from ingot.engine.engine import Engine
from ingot.runner.batch import draft_kv_lag
from tests.engine.test_speculative import PROMPTS, greedy_params, run, same
from tests.helpers import hf_model, watch_draft_steps, write_tiny_checkpoint

VOCAB = 300  # the tiny tokenizer's tokens: the models below have no padded rows unless said


def draft_spec(path, k: int = 4, **extra) -> dict:
    return {"model": str(path), "num_speculative_tokens": k, **extra}


def resized(src, dst, vocab: int, dominant_pad: bool = False):
    """``src``'s weights with the embedding table and lm_head cut or padded to ``vocab`` rows
    (the same tokenizer); ``dominant_pad``: the padded lm_head rows outscore every real token, so
    a draft that proposed past the vocabulary would never be kept."""
    model = hf_model(src)
    old = model.config.vocab_size
    model.resize_token_embeddings(vocab, mean_resizing=False)
    if dominant_pad and vocab > old:
        with torch.no_grad():
            model.get_output_embeddings().weight[old:] = torch.randn(vocab - old, model.config.hidden_size) * 50
    model.save_pretrained(dst, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = write_tiny_checkpoint(root / "target", "llama", overrides={"vocab_size": VOCAB})
    return {
        "target": target,
        "other": write_tiny_checkpoint(root / "other", "qwen2", seed=7, overrides={"vocab_size": VOCAB}),
        "padded": resized(target, root / "padded", VOCAB + 84, dominant_pad=True),
        "wide": write_tiny_checkpoint(root / "wide", "llama", seed=1, overrides={"vocab_size": 384}),
    }


def all_kept(stats) -> None:
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens, "every draft kept"


def params_with_edges() -> list[SamplingParams]:
    """The n-gram tests' greedy parameters (logprobs, n=2, stop strings, stop tokens) and
    max_tokens edges: 1 (no decode step), 2 (one draft at most), 6 (k + 2)."""
    return greedy_params() + [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 2, 6)]


def test_greedy_with_itself_as_draft_keeps_every_draft(models):
    prompts = PROMPTS + PROMPTS[:3]
    plain, _, _ = run(models["target"], None, prompts, params_with_edges())
    spec, metrics, stats = run(models["target"], draft_spec(models["target"]), prompts, params_with_edges())
    same(spec, plain)
    all_kept(stats)
    assert stats.spec_decode_num_drafts == sum(m.spec_num_drafts for m in metrics)
    assert max(m.spec_mean_accepted_length or 0 for m in metrics) == 4


def test_greedy_with_another_draft_equals_plain_greedy(models):
    plain, _, _ = run(models["target"], None, PROMPTS, greedy_params())
    spec, _, stats = run(models["target"], draft_spec(models["other"], k=3), PROMPTS, greedy_params())
    same(spec, plain)
    assert stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens / 2, "a random draft rarely agrees"


def test_preemption_and_no_prefix_caching_or_overlap(models):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain, _, _ = run(models["target"], None, PROMPTS, params, num_kv_blocks=14, overlap_scheduling=False)
    spec, _, stats = run(models["target"], draft_spec(models["target"]), PROMPTS, params, num_kv_blocks=14,
                         enable_prefix_caching=False)
    same(spec, plain)
    assert stats.num_preemptions > 0
    all_kept(stats)
    spec, _, stats = run(models["target"], draft_spec(models["target"]), PROMPTS, params, num_kv_blocks=14,
                         overlap_scheduling=False)
    same(spec, plain)
    assert stats.num_preemptions > 0
    all_kept(stats)


def test_prefix_cache_hits_hold_the_drafts_cache_too(models):
    """Prompts that continue earlier outputs hit blocks that decode and verify steps wrote:
    the draft's K/V in them is right (the target as its own draft still keeps every draft)."""
    params = SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True)
    spec = draft_spec(models["target"])
    common = dict(dtype="float32", device="cpu", show_progress=False, speculative_config=spec)
    with LLM(str(models["target"]), **common) as llm:
        first = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        follow = [{"prompt_token_ids": o.prompt_token_ids + o.outputs[0].token_ids + [5, 6]} for o in first]
        second = llm.generate(follow, params, use_tqdm=False)
        stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 3 * 48, "the continued prompts reused their blocks"
    all_kept(stats)
    with LLM(str(models["target"]), dtype="float32", device="cpu", show_progress=False) as llm:
        expected = llm.generate(follow, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in expected]


def poison_draft_kv(draft, seq, position: int) -> None:
    """NaN into the draft's K/V of ``seq`` at ``position``: a draft step reading it before one
    writes it again gives NaN logits, so drafts the target does not keep."""
    bs = draft.block_size
    slot = seq.block_ids[position // bs] * bs + position % bs
    for attn in draft.model.attention_layers():
        for cache in (attn.k_cache, attn.v_cache):
            cache.view(-1, *cache.shape[2:])[slot] = float("nan")


def test_the_last_draft_of_a_round_that_kept_every_draft_is_fed_after_steps_the_draft_sat_out(models, monkeypatch):
    """One sequence speculates alone (disable_by_batch_size 1) and keeps every draft, so the
    draft lacks the K/V of its last draft (NaN there); a second request joins, so the next steps
    are plain decode steps, which the draft sits out (no draft forward at all); once the newcomer
    ends, speculation resumes, the missing K/V caught up first, and still keeps every draft."""
    spec = draft_spec(models["target"], disable_by_batch_size=1)
    engine = Engine(EngineConfig(model=str(models["target"]), dtype="float32", device="cpu", show_progress=False,
                                 speculative_config=spec))
    draft = engine.executor.draft
    calls = []
    for name in ("fill_kv", "forward_logits"):
        real = getattr(draft, name)
        monkeypatch.setattr(draft, name, lambda inputs, real=real: calls.append(inputs) or real(inputs))
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = engine.add_request(PROMPTS[0], greedy)
    for _ in range(5):  # the prefill step, then its first round keeps every draft
        engine.step()
        if draft_kv_lag(first) == 1:
            break
    assert draft_kv_lag(first) == 1, "a round kept every draft, the last one's draft K/V missing"
    poison_draft_kv(draft, first, first.draft_kv_len)
    second = engine.add_request(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    drafts_before = engine.stats().spec_decode_num_drafts
    calls.clear()
    while not second.finished:
        engine.step()
    assert not calls, "the draft sat out the steps of two sequences"
    assert draft_kv_lag(first) > 1
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert any(c.attn.is_prefill for c in calls), "the missing draft K/V was caught up"
    assert stats.spec_decode_num_drafts > drafts_before, "speculation resumed"
    all_kept(stats)
    with LLM(str(models["target"]), dtype="float32", device="cpu", show_progress=False) as llm:
        expected = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert first.output_token_ids == expected


def test_seeded_sampling_is_deterministic_whatever_the_batch(models):
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True, n=2, logprobs=1)
    spec = draft_spec(models["target"])
    alone, metrics, _ = run(models["target"], spec, [PROMPTS[0]], seeded)
    assert metrics[0].spec_num_accepted_tokens > 0
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batched, _, _ = run(models["target"], spec, PROMPTS[:3], [seeded, other, other])
    same(batched[:1], alone)


def test_sampling_with_a_draft_keeps_the_target_distribution(models):
    """Temperature 0.5, top-k 5, one draft from another model (drawn from its distribution q,
    kept with probability min(1, p / q), else the residual): the token after the first follows
    the target's distribution, computed by HF transformers on the same weights (chi-square,
    2,000 requests)."""
    from tests.helpers import hf_logits
    from tests.runner.test_spec_verify import CHI2_99_9, chi_square

    prompt = [5, 17, 42, 9, 77, 120, 33]
    params = SamplingParams(temperature=0.5, top_k=5, max_tokens=3, ignore_eos=True)
    spec = draft_spec(models["other"], k=1, disable_by_batch_size=512)
    with LLM(str(models["target"]), dtype="float32", device="cpu", show_progress=False, max_num_seqs=512,
             speculative_config=spec) as llm:
        outs = llm.generate([{"prompt_token_ids": prompt}] * 2000, params, use_tqdm=False)
        stats = llm.engine.stats()
    pairs = [o.outputs[0].token_ids[:2] for o in outs]
    first = max(set(t for t, _ in pairs), key=[t for t, _ in pairs].count)
    seconds = torch.tensor([u for t, u in pairs if t == first])
    logits = hf_logits(models["target"], prompt + [first])[-1].double() / 0.5
    top = logits.topk(5)
    p = torch.zeros_like(logits)
    p[top.indices] = top.values.softmax(-1)
    assert chi_square(torch.bincount(seconds, minlength=VOCAB).double(), p) < CHI2_99_9[5]
    assert len(seconds) > 300 and 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_sampled_drafts_from_itself_are_kept(models):
    """A sampled request drafts from the draft's own distribution: with the target as its
    draft q = p (up to rounding), so min(1, p / q) keeps (nearly) every draft, where a point
    mass (the draft's argmax) would be kept with probability p(x) only."""
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=11)
    _, _, stats = run(models["target"], draft_spec(models["target"]), PROMPTS, params)
    assert stats.spec_decode_num_accepted_tokens >= 0.98 * stats.spec_decode_num_draft_tokens > 0


def test_padded_embedding_tables(models):
    """A draft whose table has 84 padded rows (their logits outscore every real token) proposes
    only real tokens: every draft kept. A draft whose table is smaller than the target's (the
    target's extra rows are sampled here: random weights) is fed those tokens as its last row."""
    plain, _, _ = run(models["target"], None, PROMPTS, greedy_params())
    spec, _, stats = run(models["target"], draft_spec(models["padded"]), PROMPTS, greedy_params())
    same(spec, plain)
    all_kept(stats)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain, _, _ = run(models["wide"], None, PROMPTS, params)
    assert any(t >= VOCAB for r in plain for t in r[0][0]), "the wide target emits ids past the draft's table"
    spec, _, stats = run(models["wide"], draft_spec(models["target"]), PROMPTS, params)
    same(spec, plain)
    assert stats.spec_decode_num_drafts > 0


def test_a_quantized_draft(models):
    """``quantization`` applies to the draft alone: int8 rounds its weights (dequantized at load
    on CPU), the target's stay; output is plain greedy decoding's."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain, _, _ = run(models["target"], None, PROMPTS[:3], params)
    spec = draft_spec(models["target"], quantization="int8")
    with LLM(str(models["target"]), dtype="float32", device="cpu", show_progress=False, speculative_config=spec) as llm:
        runner = llm.engine.executor
        target_w = runner.model.layers[0].mlp.down_proj.weight
        draft_w = runner.draft.model.layers[0].mlp.down_proj.weight
        assert not torch.equal(target_w, draft_w) and torch.allclose(target_w, draft_w, atol=2e-3)
        outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        stats = llm.engine.stats()
    assert [[o.outputs[0].token_ids] for o in outs] == [[r[0][0]] for r in plain]
    assert stats.spec_decode_num_accepted_tokens > stats.spec_decode_num_draft_tokens / 2


def test_draft_steps_through_the_padded_buckets(models, cpu_buckets):
    """On the graphs' path (CPU_BUCKETS): while three sequences run (above
    disable_by_batch_size 2) the draft sits out; once one ends, its decode buckets and its
    first-step buckets (a missing token fed, store_first) replay the draft rounds, and a
    plain step it follows without a missing token (here only every third step proposes, as
    when the sequences' backoffs keep them from proposing) its K/V-only buckets. Every set
    holds the batch sizes that speculate alone. Output and acceptance unchanged."""
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (30, 30, 8)]
    common = dict(dtype="float32", device="cpu", show_progress=False, max_num_seqs=4)
    with LLM(str(models["target"]), **common) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
    spec = draft_spec(models["target"], disable_by_batch_size=2)
    with LLM(str(models["target"]), speculative_config=spec, **common) as llm:
        draft = llm.engine.executor.draft
        assert draft.graphs.buckets == draft.kv_graphs.buckets == [1, 2] and draft.verify_graphs.buckets == [2, 3, 4]
        rows = watch_draft_steps(llm)
        spec_out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
        stats = llm.engine.stats()
    assert spec_out == plain
    all_kept(stats)
    assert rows["decode"] and rows["first"] and rows["kv"], f"every set replayed: {rows}"
    assert max(rows["decode"] + rows["kv"]) <= 2, "the draft never ran on three sequences"


@pytest.mark.parametrize("spec, message", [
    (lambda m: draft_spec("/no/such/draft"), "the draft model '/no/such/draft' cannot be opened"),
    (lambda m: draft_spec(m["target"], k=0), "num_speculative_tokens must be a positive integer"),
    (lambda m: draft_spec(m["target"], k=17), "num_speculative_tokens must be in 1..16"),
    (lambda m: draft_spec("qwen2.5-1.5b"), "has another vocabulary than the target"),
    (lambda m: draft_spec(m["target"], draft_tensor_parallel_size=2), "draft_tensor_parallel_size must be 1"),
    (lambda m: {"method": "draft_model", "num_speculative_tokens": 2}, "method 'draft_model' needs 'model'"),
    (lambda m: {"method": "ngram", "model": str(m["target"]), "num_speculative_tokens": 2}, "method must be 'draft_model'"),
    (lambda m: draft_spec(m["target"], prompt_lookup_max=3), "apply to method 'ngram'"),
])
def test_bad_drafts_are_refused_at_start(models, spec, message):
    with pytest.raises(ConfigError, match="speculative_config: .*" + re.escape(message)):
        LLM(str(models["target"]), dtype="float32", device="cpu", show_progress=False, speculative_config=spec(models))


def test_a_draft_with_another_tokenizer_is_refused(models, tmp_path):
    """Two tokens with their ids swapped are enough."""
    other = shutil.copytree(models["other"], tmp_path / "swapped")
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match="another vocabulary than the target: 2 of 300 tokens differ"):
        LLM(str(models["target"]), device="cpu", show_progress=False, speculative_config=draft_spec(other))


def test_a_useless_draft_backs_off_to_a_few_attempts(models):
    """A random draft of another model that keeps nothing of this prompt: its request of 256
    greedy tokens drafts at its steps 0, 1, 2, 7, 16, 33, 66 and 131 (a pause after the third
    failure, then after each one, doubling up to 256 steps for a draft model: ngram.py), 8
    attempts, not the twenty-odd a pause capped at 32 steps allowed."""
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    plain, _, _ = run(models["target"], None, PROMPTS[:1], params)
    spec, metrics, _ = run(models["target"], draft_spec(models["other"], k=4), PROMPTS[:1], params)
    same(spec, plain)
    assert metrics[0].spec_num_accepted_tokens == 0
    assert metrics[0].spec_num_drafts == 8
