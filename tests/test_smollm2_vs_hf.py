"""The real default model: ingot greedy == HF transformers greedy (fp32, CPU), and batch invariance."""

from __future__ import annotations

import pytest
import torch

from ingot import LLM, SamplingParams

NEW_TOKENS = 48
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one sentence."}, {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a short poem about autumn leaves."}],
]
PLAIN = [
    "The quick brown fox",
    "def quicksort(arr):",
    "In 1492, Columbus",
    "Les trois mousquetaires sont",
]
LONG = " ".join(f"Item {i}: the value of {i} squared is {i * i}." for i in range(60)) + " Summary:"


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    return LLM(str(smollm2_gguf), dtype="float32", device="cpu", show_progress=False, max_model_len=2048)


@pytest.fixture(scope="module")
def prompt_ids(llm):
    tok = llm.get_tokenizer()
    ids = [tok.encode_chat(c) for c in CHATS] + [tok.encode(p) for p in PLAIN] + [tok.encode(LONG)]
    assert len(ids[-1]) > 500
    return ids


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain greedy loop over HF's KV cache (EOS is just another token, as with ignore_eos)."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(n):
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
        out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def test_greedy_matches_hf_transformers(llm, prompt_ids, hf_model):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompt_ids, params)]
    for ids, got in zip(prompt_ids, ours):
        ref = hf_greedy(hf_model, ids, NEW_TOKENS)
        assert got == ref, f"prompt of {len(ids)} tokens diverges at {next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)}"


def test_batch_invariance_alone_batched_and_preempted(smollm2_gguf, llm, prompt_ids):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompt_ids, params)]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompt_ids[:4]]
    assert alone == batched[:4]
    # A KV pool far too small for the 7 short prompts at once: forces preemption and recompute.
    short = prompt_ids[:7]
    blocks = sum(-(-(len(p) + 24) // 16) for p in short) // 2
    small = LLM(str(smollm2_gguf), dtype="float32", device="cpu", show_progress=False,
                max_model_len=128, num_kv_blocks=blocks + 1, max_num_batched_tokens=64)
    squeezed = [o.outputs[0].token_ids for o in small.generate(short, params)]
    assert small.engine.scheduler.stats.num_preemptions > 0, "the test must exercise preemption"
    assert squeezed == batched[:7]
