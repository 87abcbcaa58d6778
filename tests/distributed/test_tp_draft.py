"""Speculative decoding with a draft beside a tensor-parallel target (CPU, gloo, real worker
processes): the draft model or EAGLE head runs whole on the driver, the target's steps on every
rank. A draft model drafting for itself keeps every draft and gives TP1's plain greedy tokens;
an EAGLE head (reading the driver's hidden rows, its shared vocabulary tables gathered whole
from the ranks' slices, padded and tied ones too) drafts what the independent reference drafts."""

from __future__ import annotations

import pytest

from ingot import LLM, SamplingParams
from tests.engine.eagle_heads import check_against_reference, write_eagle1, write_eagle3
from tests.engine.test_eagle import spec
from tests.helpers import hf_model, write_tiny_checkpoint

ENGINE = dict(device="cpu", dtype="float32", show_progress=False, max_num_batched_tokens=16, max_model_len=128,
              max_num_seqs=4)
PROMPTS = ["the quick brown fox jumps over the lazy dog. the quick", "hello world hello world", "lazy"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def generate(path, size: int, speculative=None):
    with LLM(str(path), tensor_parallel_size=size, speculative_config=speculative, **ENGINE) as llm:
        out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        return out, llm.engine.stats()


def test_a_draft_model_beside_a_tp2_target(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "qwen3", "qwen3", overrides={"vocab_size": 300})  # (no rows past the tokenizer)
    plain, _ = generate(path, 1)
    out, stats = generate(path, 2, {"model": str(path), "num_speculative_tokens": 3})
    assert out == plain
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0


@pytest.mark.parametrize("arch,variant", [("llama", "eagle3"), ("qwen2", "eagle")])
def test_an_eagle_head_beside_a_tp2_target(tmp_path, proposals, agreeing, arch, variant):
    """Llama (the lm_head its own) with an EAGLE-3 head; Qwen2 (tied embeddings, 385 ids padded to
    386 over two ranks) with an EAGLE-1 head, which reads the target's lm_head."""
    target = write_tiny_checkpoint(tmp_path / arch, arch, overrides={"vocab_size": 385, "num_hidden_layers": 8})
    head = (write_eagle3(tmp_path / "head", 385, draft_vocab=120) if variant == "eagle3"
            else write_eagle1(tmp_path / "head", 385, seed=2))
    _, stats = generate(target, 2, spec(head, variant))
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    check_against_reference({"hf": hf_model(target), "head": head}, "head", variant, proposals)


def test_eagle_output_over_tp2_is_tp1_plain_greedy(tmp_path):
    target = write_tiny_checkpoint(tmp_path / "llama", "llama", overrides={"vocab_size": 300, "num_hidden_layers": 8})
    head = write_eagle3(tmp_path / "head", 300, draft_vocab=120)
    plain, _ = generate(target, 1)
    out, stats = generate(target, 2, spec(head, "eagle3"))
    assert out == plain and stats.spec_decode_num_drafts > 0
