"""ingot vs HF transformers (fp32) on a tiny random gpt-oss checkpoint: attention sinks, sliding
windows (8 tokens, shorter than prompt + generation) alternating with full attention, YaRN,
q/k/v/o biases, the biased router's softmax over the top-k logits, biased experts with the
clamped SwiGLU."""

from __future__ import annotations

import pytest
import torch

from ingot import LLM, SamplingParams
from ingot.config import EngineConfig
from ingot.engine.engine import Engine
from ingot.loading.errors import CheckpointError
from ingot.loading.model_config import ModelConfig
from tests.helpers import hf_logits, hf_model, ingot_logits
from tests.models.gpt_oss_cases import write_gpt_oss


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_gpt_oss(tmp_path_factory.mktemp("gpt_oss"), seed=1)


def test_logits_match_hf(checkpoint):
    engine = Engine(EngineConfig(model=str(checkpoint), dtype="float32", device="cpu", show_progress=False))
    ids = torch.randint(3, 380, (36,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = hf_logits(checkpoint, ids)
    got = ingot_logits(engine, ids, prefill_len=22, chunk=7)  # chunks cross the window; then decode
    err = (got - ref).norm() / ref.norm()
    assert err < 1e-5, f"relative logit error {err:.2e}"
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_generate_matches_hf_generate(checkpoint):
    """Two prompts of different lengths batched through the whole engine: greedy tokens equal HF's."""
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", show_progress=False)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 380, (n,), generator=gen).tolist() for n in (21, 17)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    reference = hf_model(checkpoint)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            full = reference.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                      pad_token_id=0)
        assert out.outputs[0].token_ids == full[0, len(prompt):].tolist()


def _config(**fields) -> dict:
    base = dict(architectures=["GptOssForCausalLM"], hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                intermediate_size=32, vocab_size=100, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
    return {**base, **fields}


@pytest.mark.parametrize("fields,named", [
    (dict(layer_types=["sliding_attention"]), "layer_types"),
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "layer_types"),
    (dict(sliding_window=-4), "sliding_window"),
    (dict(swiglu_limit=0.0), "swiglu_limit"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 0.0, "original_max_position_embeddings": 64}), "factor"),
])
def test_bad_configs_name_the_field(fields, named):
    with pytest.raises(CheckpointError, match=named):
        ModelConfig.from_hf(_config(**fields))


def test_config_fields():
    cfg = ModelConfig.from_hf(_config())
    assert cfg.layer_windows == (8, 0) and cfg.attn_sinks and cfg.expert_bias and cfg.router_bias
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0) and cfg.moe_intermediate_size == 32
    assert cfg.qkv_bias and cfg.o_bias  # HF's default attention_bias for gpt-oss: True
    assert not ModelConfig.from_hf(_config(attention_bias=False)).o_bias


def test_shape_gpt_oss_20b():
    from ingot.loading.dummy import shape_config

    cfg = ModelConfig.from_hf(shape_config("gpt-oss-20b"))
    assert cfg.layer_windows == (128, 0) * 12 and (cfg.num_experts, cfg.num_experts_per_tok) == (32, 4)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_theta == 150000.0 and cfg.head_dim == 64
