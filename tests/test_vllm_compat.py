"""vLLM's offline API, as its documentation uses it, on a tiny random checkpoint; where a
value can be computed independently (HF transformers' tokenizer and model on the same
files), it is compared against that."""

from __future__ import annotations

import math

import pytest
import torch

from ingot import LLM, ConfigError, Logprob, RequestOutput, SamplingParams
from tests.helpers import hf_logits, write_tiny_checkpoint


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("vllm") / "llama", "llama")


@pytest.fixture(scope="module")
def llm(path):
    llm = LLM(model=str(path), dtype="float32", device="cpu", show_progress=False, enforce_eager=True)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def hf_tok(path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path))


def test_quickstart(llm):
    # vLLM's quickstart: prompts, SamplingParams(temperature=0.8, top_p=0.95), outputs[0].text
    prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95))
    assert [o.prompt for o in outputs] == prompts
    for output in outputs:
        assert isinstance(output, RequestOutput) and output.finished
        assert isinstance(output.outputs[0].text, str) and len(output.outputs[0].token_ids) == 16


def test_prompt_dicts(llm):
    ids = llm.get_tokenizer().encode("hello world")
    params = SamplingParams(temperature=0.0, max_tokens=6)
    by_text = llm.generate({"prompt": "hello world"}, params)[0]
    by_ids = llm.generate([{"prompt_token_ids": ids}], params)[0]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_ids.prompt is None and by_ids.prompt_token_ids == ids


def test_n_samples_with_a_seed_are_reproducible(llm):
    params = SamplingParams(n=4, temperature=0.8, seed=42, max_tokens=12, ignore_eos=True)
    a, b = (llm.generate("hello world", params)[0] for _ in range(2))
    assert [c.index for c in a.outputs] == [0, 1, 2, 3]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1, "n samples should differ"
    # sample 0 is what the same request with n=1 draws
    one = llm.generate("hello world", SamplingParams(temperature=0.8, seed=42, max_tokens=12, ignore_eos=True))[0]
    assert one.outputs[0].token_ids == a.outputs[0].token_ids
    assert SamplingParams(n=3, best_of=3).best_of == 3
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=2, best_of=4)


def test_logprobs_are_logprob_objects_matching_hf(llm, path):
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True)
    out = llm.generate("hello world", params)[0]
    comp = out.outputs[0]
    ref = torch.log_softmax(hf_logits(path, out.prompt_token_ids + comp.token_ids), dim=-1)
    p = len(out.prompt_token_ids)
    total = 0.0
    for i, (token, lps) in enumerate(zip(comp.token_ids, comp.logprobs)):
        assert all(isinstance(v, Logprob) for v in lps.values()) and len(lps) == 3
        row = ref[p - 1 + i]
        assert lps[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert lps[token].rank == 1
        top = row.topk(3).indices.tolist()
        assert set(lps) == set(top)
        assert [lps[t].rank for t in top] == [1, 2, 3]
        assert lps[token].decoded_token == llm.get_tokenizer().decode([token])
        total += lps[token].logprob
    assert comp.cumulative_logprob == pytest.approx(total, abs=1e-6)


def test_prompt_logprobs_match_hf(llm, path):
    prompt = "the quick brown fox jumps"
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))[0]
    ids = out.prompt_token_ids
    ref = torch.log_softmax(hf_logits(path, ids), dim=-1)
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        entry = out.prompt_logprobs[i]
        assert entry[ids[i]].logprob == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        assert entry[ids[i]].rank == 1 + int((ref[i - 1] > ref[i - 1, ids[i]]).sum())
        assert {t for t, v in entry.items() if v.rank <= 2} >= set(ref[i - 1].topk(2).indices.tolist())


def test_prompt_logprobs_across_prefill_chunks(path):
    with LLM(str(path), dtype="float32", device="cpu", show_progress=False, max_num_batched_tokens=4) as small:
        prompt = "the quick brown fox jumps over the lazy dog"
        out = small.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    ids = out.prompt_token_ids
    assert len(ids) > 8, "the prompt must span several chunks"
    ref = torch.log_softmax(hf_logits(path, ids), dim=-1)
    got = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    assert got == pytest.approx([ref[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-4)


def test_metrics_are_ordered(llm):
    out = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=4))[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.time_in_queue >= 0 and m.num_preemptions == 0


def test_chat_options_match_hf_templates(llm, hf_tok):
    conv = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi! How can"}]
    params = SamplingParams(temperature=0.0, max_tokens=3)
    out = llm.chat(conv[:2], params, use_tqdm=False)[0]
    assert out.prompt_token_ids == hf_tok.apply_chat_template(conv[:2], add_generation_prompt=True, tokenize=True, return_dict=False)
    cont = llm.chat(conv, params, add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.prompt_token_ids == hf_tok.apply_chat_template(conv, continue_final_message=True, tokenize=True, return_dict=False)
    custom = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    mine = llm.chat(conv[:2], params, chat_template=custom)[0]
    assert mine.prompt_token_ids == hf_tok.apply_chat_template(conv[:2], chat_template=custom, tokenize=True, return_dict=False)
    bad = llm.chat([conv[:2], [{"role": "user"}]], params)
    assert bad[0].error is None and "role" in bad[1].error


def test_get_tokenizer_behaves_like_hf(llm, hf_tok):
    tok = llm.get_tokenizer()
    text = "The quick brown fox, hello tokens!"
    assert tok(text).input_ids == hf_tok(text).input_ids
    assert tok(text)["attention_mask"] == hf_tok(text)["attention_mask"]
    assert tok([text, "def"]).input_ids == hf_tok([text, "def"]).input_ids
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text)
    assert tok.decode(ids) == hf_tok.decode(ids)
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == hf_tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True)
    assert tok.convert_ids_to_tokens(ids) == hf_tok.convert_ids_to_tokens(ids)
    assert tok.eos_token_id == hf_tok.eos_token_id
    conv = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True) == \
        hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert dict(tok.apply_chat_template(conv)) == dict(hf_tok.apply_chat_template(conv))  # transformers 5 default


def test_unsupported_features_say_so(path):
    with pytest.raises(ConfigError, match="LoRA"):
        LLM(str(path), device="cpu", enable_lora=True)
    with pytest.raises(ConfigError, match="unknown engine argument"):
        LLM(str(path), device="cpu", max_paddings=3)
    llm = LLM(str(path), device="cpu", show_progress=False, trust_remote_code=True, enforce_eager=False)
    with pytest.raises(ConfigError, match="LoRA"):
        llm.generate("hi", lora_request=object())
    assert not math.isnan(llm.config.gpu_memory_utilization)
    llm.shutdown()


def test_n_samples_share_the_prompt_blocks(llm):
    """Samples 2..n reuse sample 1's cached prompt blocks: only the last partial block
    (at least the last token) is computed again."""
    ids = list(range(5, 5 + 40))  # 2 full blocks of 16 and 8 tokens more
    before = llm.engine.stats()
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(n=4, temperature=0.9, seed=1, max_tokens=4))[0]
    after = llm.engine.stats()
    assert len(out.outputs) == 4
    assert after.prefix_cache_hits - before.prefix_cache_hits == 3 * 32
    salted = [llm.generate({"prompt_token_ids": ids, "cache_salt": salt}, SamplingParams(max_tokens=1))[0] for salt in ("a", "b")]
    assert [o.num_cached_tokens for o in salted] == [0, 0]  # another tenant's blocks never match
    again = llm.generate({"prompt_token_ids": ids, "cache_salt": "a"}, SamplingParams(max_tokens=1))[0]
    assert again.num_cached_tokens == 32
